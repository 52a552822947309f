"""Who may do what on the Allocator API (pure; the servicer asks, the interceptor reports the refusal).

A ``tenant`` identity acts only as its own tenant: its submissions carry its tenant whatever ``spec.tenant``
says (empty is filled in, another tenant is refused), and another tenant's job is ``NOT_FOUND`` to it — the
same answer as a job that does not exist, so job ids cannot be probed across tenants. ``scheduler`` and
``operator`` act for every tenant; ``node`` identities have no call here. ``None`` (no token layer: an
explicit ``ELASTICO_INSECURE=1`` run without a tokens file) allows everything.
"""

from __future__ import annotations

from dataclasses import replace

from elastico.auth import Identity
from elastico.domain import Job, JobSpec
from elastico.errors import NotFound, PermissionDenied


def require_api_role(identity: Identity | None) -> None:
    if identity is not None and identity.role == "node":
        raise PermissionDenied(f"identity {identity.name!r} (role node) has no Allocator API access")


def submission_spec(identity: Identity | None, spec: JobSpec, requested_tenant: str) -> JobSpec:
    """The spec as stored for this caller: the tenant fixed to its identity, the command allowed for it.

    ``requested_tenant`` is the request's ``spec.tenant`` as sent ("" = unset).

    Raises:
        PermissionDenied: a tenant naming another tenant (``spec.tenant``), or a command outside the caller's
            allow-list (``spec.command``).
    """
    if identity is None:
        return spec
    require_api_role(identity)
    if identity.role == "tenant":
        if requested_tenant and requested_tenant != identity.tenant:
            raise PermissionDenied(f"identity {identity.name!r} submits for tenant {identity.tenant!r} only", "spec.tenant")
        spec = replace(spec, tenant=identity.tenant)
    if spec.command and not identity.may_run(spec.command):
        raise PermissionDenied(f"identity {identity.name!r} may not run this command (not in its allow-list)", "spec.command")
    return spec


def visible_tenant(identity: Identity | None) -> str | None:
    """The only tenant the caller may see (None: every tenant)."""
    require_api_role(identity)
    return identity.tenant if identity is not None and identity.role == "tenant" else None


def check_job(identity: Identity | None, job: Job) -> Job:
    """``job`` if the caller may see it; otherwise NotFound, exactly as for an unknown id."""
    tenant = visible_tenant(identity)
    if tenant is not None and job.spec.tenant != tenant:
        raise NotFound(f"job {job.job_id} not found")
    return job


def list_tenant(identity: Identity | None, requested: str) -> str:
    """The tenant filter a ListJobs call runs with. Raises PermissionDenied naming ``tenant`` for another tenant."""
    tenant = visible_tenant(identity)
    if tenant is None:
        return requested
    if requested and requested != tenant:
        raise PermissionDenied(f"identity {identity.name!r} lists tenant {tenant!r} only", "tenant")
    return tenant
