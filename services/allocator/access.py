"""Who may do what on the Allocator API (pure; the servicer asks, the interceptor reports the refusal).

A ``tenant`` identity acts only as its own tenant: its submissions carry its tenant whatever ``spec.tenant``
says (empty is filled in, another tenant is refused), and another tenant's job is ``NOT_FOUND`` to it — the
same answer as a job that does not exist, so job ids cannot be probed across tenants. ``scheduler`` and
``operator`` act for every tenant; ``node`` identities have no call here. ``None`` (no token layer: an
explicit ``ELASTICO_INSECURE=1`` run without a tokens file) allows everything.

Kubernetes pod jobs: label keys under :data:`RESERVED_LABEL_PREFIX` (``elastico.io/pod``, ``-pod-owner``, gang
labels, ...) say that a job is a pod's and decide how ElastiCo treats it (never released before its pod is gone,
evicted rather than preempted), so only the ``scheduler`` and ``operator`` identities -- the kube extender --
may submit them; and a tenant cancels a pod's job by deleting the pod, not through CancelJob (the pod's
containers would keep running on GPUs the cancel released).
"""

from __future__ import annotations

from dataclasses import replace

from elastico.auth import Identity
from elastico.domain import POD_LABEL, Job, JobSpec, is_pod_job, label
from elastico.errors import NotFound, PermissionDenied, WrongState

RESERVED_LABEL_PREFIX = "elastico.io/"  # label keys only the scheduler and operator identities may submit


def require_api_role(identity: Identity | None) -> None:
    if identity is not None and identity.role == "node":
        raise PermissionDenied(f"identity {identity.name!r} (role node) has no Allocator API access")


def submission_spec(identity: Identity | None, spec: JobSpec, requested_tenant: str) -> JobSpec:
    """The spec as stored for this caller: the tenant fixed to its identity, the command allowed for it.

    ``requested_tenant`` is the request's ``spec.tenant`` as sent ("" = unset).

    Raises:
        PermissionDenied: a tenant naming another tenant (``spec.tenant``) or submitting a reserved label
            (``spec.labels``), or a command outside the caller's allow-list (``spec.command``).
    """
    if identity is None:
        return spec
    require_api_role(identity)
    if identity.role == "tenant":
        if requested_tenant and requested_tenant != identity.tenant:
            raise PermissionDenied(f"identity {identity.name!r} submits for tenant {identity.tenant!r} only", "spec.tenant")
        reserved = sorted(k for k, _ in spec.labels if k.startswith(RESERVED_LABEL_PREFIX))
        if reserved:
            raise PermissionDenied(f"label keys under {RESERVED_LABEL_PREFIX!r} are reserved for the Kubernetes extender; "
                                   f"identity {identity.name!r} (role tenant) may not set {', '.join(reserved)}", "spec.labels")
        if spec.priority > identity.max_priority:
            raise PermissionDenied(f"identity {identity.name!r} (role tenant) may submit priority {identity.max_priority} "
                                   f"at most, got {spec.priority} (its token's max_priority; an operator raises it)",
                                   "spec.priority")
        spec = replace(spec, tenant=identity.tenant)
    if spec.command and not identity.may_run(spec.command):
        raise PermissionDenied(f"identity {identity.name!r} may not run this command (not in its allow-list)", "spec.command")
    return spec


def visible_tenant(identity: Identity | None) -> str | None:
    """The only tenant the caller may see (None: every tenant)."""
    require_api_role(identity)
    return identity.tenant if identity is not None and identity.role == "tenant" else None


def check_job(identity: Identity | None, job: Job) -> Job:
    """``job`` if the caller may see it; otherwise NotFound, exactly as the store answers for an unknown id."""
    tenant = visible_tenant(identity)
    if tenant is not None and job.spec.tenant != tenant:
        raise NotFound(f"job {job.job_id!r} not found")
    return job


def check_cancel(identity: Identity | None, job: Job) -> Job:
    """``job`` (already visible to the caller) if the caller may cancel it. Raises WrongState (FAILED_PRECONDITION)
    for a tenant cancelling a pod's job: the pod is what to delete (its job ends when the pod is gone)."""
    if identity is not None and identity.role == "tenant" and is_pod_job(job.spec):
        raise WrongState(f"job {job.job_id} is the job of pod {label(job.spec, POD_LABEL) or '?'}: delete the pod "
                         "(its GPUs are released once its containers are gone)")
    return job


def list_tenant(identity: Identity | None, requested: str) -> str:
    """The tenant filter a ListJobs call runs with. Raises PermissionDenied naming ``tenant`` for another tenant."""
    tenant = visible_tenant(identity)
    if tenant is None:
        return requested
    if requested and requested != tenant:
        raise PermissionDenied(f"identity {identity.name!r} lists tenant {tenant!r} only", "tenant")
    return tenant
