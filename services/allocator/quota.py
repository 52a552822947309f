"""Per-tenant service quotas (pure: no I/O): how many GPUs one tenant's inference services may take in all.

A service outranks every training job (the policy never sacrifices it for one), and its size follows demand
that its own tenant reports (``ReportDemand``) or that its own workload's metrics show. Unbounded, one tenant
could take other tenants' GPUs by inflating that demand or by submitting many services. A service is never
sized past its gang (one GPU, or the GPUs its shapes declare), so counting each service at its gang bounds what a
tenant's services can take whatever demand they report: with a quota of ``Q`` GPUs, running services keep
running (oldest placement first) and queued ones are admitted in submission order while the tenant's count stays
within ``Q``; the others wait, saying why.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from elastico.domain import TENANT_RE, Job, JobKind, JobState
from elastico.errors import ConfigError
from services.allocator.fit import spec_num_gpus

ANY_TENANT = "*"
_ENTRY = re.compile(r"^([^=\s]+)\s*=\s*(\S+)$")


def parse_quotas(text: str, variable: str = "ELASTICO_SERVICE_QUOTA_GPUS") -> dict[str, int]:
    """``"team-a=16, team-b=4, *=8"`` -> ``{"team-a": 16, "team-b": 4, "*": 8}`` (GPUs, integers >= 0); ``*`` is
    every tenant not named; "" = no quota. A malformed entry is a :class:`ConfigError` naming ``variable``."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = _ENTRY.match(part)
        if m is None:
            raise ConfigError(f"{variable}: {part!r} is not TENANT=GPUS")
        name, raw = m.groups()
        if name != ANY_TENANT and not TENANT_RE.fullmatch(name):
            raise ConfigError(f"{variable}: {name!r} is not a tenant name ([A-Za-z0-9._-], or * for every other tenant)")
        if not raw.isdigit() or int(raw) > 1_000_000:
            raise ConfigError(f"{variable}: {name}={raw}: must be a whole number of GPUs in [0, 1000000]")
        if name in out:
            raise ConfigError(f"{variable}: {name} is given twice")
        out[name] = int(raw)
    return out


def quota_of(quotas: Mapping[str, int], tenant: str) -> int | None:
    """``tenant``'s quota in :func:`parse_quotas`' map: its own, else ``*``'s; None = none."""
    return quotas.get(tenant, quotas.get(ANY_TENANT))


def held_by_quota(jobs: Sequence[Job], quotas: Mapping[str, int]) -> dict[str, str]:
    """Queued services past their tenant's quota (module docstring) -> why they wait."""
    held: dict[str, str] = {}
    if not quotas:
        return held
    by_tenant: dict[str, list[Job]] = {}
    for j in jobs:
        if j.spec.kind is JobKind.INFERENCE and not j.state.terminal:
            by_tenant.setdefault(j.spec.tenant, []).append(j)
    for tenant, services in by_tenant.items():
        q = quota_of(quotas, tenant)
        if q is None:
            continue
        taken = sum(spec_num_gpus(j.spec) for j in services if j.state is not JobState.PENDING)
        for j in sorted((j for j in services if j.state is JobState.PENDING), key=lambda j: (j.submitted_at_s, j.job_id)):
            n = spec_num_gpus(j.spec)
            if taken + n > q:
                held[j.job_id] = (f"the services of tenant {tenant} take {taken} of its {q} GPUs of service quota "
                                  f"(ELASTICO_SERVICE_QUOTA_GPUS); this one needs {n} more")
            else:
                taken += n
    return held
