"""Input size limits of the v1 API: one table, enforced at the servicer edge before any expensive work.

Pure: no gRPC, protobuf or numpy. Every limit is checked where the request is converted
(``elastico.rpc.convert``, ``elastico.domain.validate_*``, the pricer and predictor servicers), before a
request is stored, padded into arrays or handed to a model; a violation is ``InvalidSpec`` (gRPC
INVALID_ARGUMENT) naming the field. String limits count characters (``len(str)``); byte limits count the
serialized protobuf size.

==============================  ==========  ======================================  ========================
Limit                           Value       Field(s)                                Why
==============================  ==========  ======================================  ========================
``REQUEST_ID_MAX_CHARS``        128         ``SubmitJobRequest.request_id``         idempotency key
``JOB_ID_MAX_CHARS``            128         ``jobs[i].job_id`` (pricer),            the allocator's job_id
                                            ``TaskProfile.job_id`` (predictor)      check uses 128 too
``NAME_MAX_CHARS``              253         ``spec.name``                           a Kubernetes object name
``TENANT_MAX_CHARS``            64          ``spec.tenant``                         (regex in ``domain``)
``MODEL_FAMILY_MAX_CHARS``      128         ``spec.model_family``,                  "ResNet-50", "BERT"...
                                            ``TaskProfile.model_family``
``PRECISION_MAX_CHARS``         32          ``spec.precision``,                     "fp32", "bf16"...
                                            ``TaskProfile.precision``
``GPU_TYPE_MAX_CHARS``          64          ``spec.shapes[i].gpu_type``,            "v100", "Tesla V100"...
                                            ``TaskProfile.gpu_type``
``COMMAND_MAX_CHARS``           4096        ``spec.command``                        a shell command line
``LABELS_MAX_COUNT``            64          ``spec.labels``                         copied to every event
``LABEL_KEY_MAX_CHARS``         317         ``spec.labels`` keys                    a Kubernetes qualified
                                                                                    key: 253 + "/" + 63
``LABEL_VALUE_MAX_CHARS``       1024        ``spec.labels`` values
``SHAPES_PER_JOB_MAX``          64          ``spec.shapes``, ``jobs[i].shapes``     the solver pads every
                                            (pricer)                                job to the longest
``ALLOWED_NODES_MAX_COUNT``     256         ``spec.allowed_nodes``
``NODE_ID_MAX_CHARS``           253         ``spec.allowed_nodes[i]``,              a DNS name
                                            ``Observation.node_id``
``JOB_SPEC_MAX_BYTES``          32 KiB      a serialized ``JobSpec`` (whole)        see below
``PRICER_POOLS_MAX``            256         ``ComputeAllocationRequest.pools``      R x R elasticity matrix
``POOL_NAME_MAX_CHARS``         128         ``pools[i].name``                       "v100/mem_mib"
``PRICER_MAX_JOBS``             200,000     ``jobs`` (``PricerSettings.max_jobs``,  default of the setting
                                            ``ELASTICO_MAX_JOBS``)
``PRICER_MAX_CELLS``            8,000,000   jobs x longest shape list x pools       dense arrays; default of
                                            (``PricerSettings.max_cells``,          the setting
                                            ``ELASTICO_MAX_CELLS``)
(setting, no constant)          10,000      ``pairs`` (``PredictorSettings``        ``ELASTICO_MAX_BATCH_PAIRS``
                                            ``.max_batch_pairs``)
``OBSERVATIONS_PER_CALL_MAX``   10,000      ``ReportObservationRequest              one stream append
                                            .observations``
``ERROR_QUOTE_MAX_CHARS``       64          user text quoted in an error message    :func:`clip`
``RATE_MIN`` / ``RATE_MAX``     1e-6 / 1e9  ``spec.shapes[i].throughput`` (or 0),   steps/s, requests/s;
                                            ``spec.inference.demand_rps``,          beyond them a rate is a
                                            ``DemandReport.request_rate_rps``       typo, and overflows the
                                            (or 0)                                  allocator's arithmetic
``LATENCY_SLO_MS_MIN`` / _MAX   1e-3 / 8.64e7  ``spec.inference.latency_slo_ms``    a microsecond to a day
``SHARE_PCT_MIN``               1           ``spec.shapes[i].compute_share_pct``    the least MPS thread
                                                                                    share a job can run at
``GPU_MEM_MIB_MAX``             16,777,216  ``spec.shapes[i].mem_mib``,             16 TiB: beyond any GPU,
                                            the kube extender's memory annotation   a typo
``BATCH_SIZE_MAX``              1,048,576   ``spec.batch_size``,                    beyond it a typo
                                            ``spec.shapes[i].batch_size``
``TOTAL_STEPS_MAX``             1e12        ``spec.training.total_steps``           beyond it a typo
``MAX_SLOWDOWN_MAX``            1000        ``spec.training.max_slowdown``          beyond it "any"
``PRICER_VALUE_MAX``            1e12        ``jobs[i].shapes[s].utility``,          sums over 200,000 jobs
                                            ``.demand[r]``, ``pools[r].capacity``   stay finite
``NORM_TPUT_MAX``               1.2         ``Observation.norm_tput_a/_b``          alone is the fastest;
                                            (predictor, node agent)                 20 % noise
``PRIORITY_MAX``                1000        ``spec.priority`` in [-1000, 1000];     the policy's weight is
                                            a tenant token's ``max_priority``       1 + priority: 1001x
                                            caps it lower (``elastico.auth``)       normal at most
==============================  ==========  ======================================  ========================

Text a person reads (names, model families, labels, node ids, commands, GPU types) must be printable
(``str.isprintable``): a control character is refused, so no terminal escape reaches an operator's screen.

``JOB_SPEC_MAX_BYTES``: the per-field limits alone would allow a ~160 KiB spec (64 labels of 1.3 KiB,
256 node ids of 253 characters, a 4 KiB command); the whole-spec cap keeps every stored job small enough
that a default ``ListJobs`` page (100 jobs) stays under gRPC's default 4 MiB client receive limit
(100 x 32 KiB = 3.2 MiB), and a ``SubmitJob`` reply (which echoes the spec) is always readable.

``PRICER_MAX_CELLS``: the pricer pads every job to the longest shape list, so its arrays hold
``jobs x max shapes x pools`` float64 cells whatever the request's wire size (a 3.4 MB request of one
64-shape job and 62,499 one-shape jobs over 4 pools is 16 M cells). A solve peaks at 25-40 bytes per cell
(measured with tracemalloc: 5.8 M dense cells 143 MiB, 16 M padded cells 620 MiB), so the 8 M default
keeps a solve near 300 MiB, well inside the pricer's 2 GiB; the densest request a 64 MiB message can
carry (9 pools x 8 shapes, ~97,000 jobs) is ~7 M cells; the ElastiCo policy prices 2 pools.
"""

from __future__ import annotations

import json

REQUEST_ID_MAX_CHARS = 128
JOB_ID_MAX_CHARS = 128
NAME_MAX_CHARS = 253
TENANT_MAX_CHARS = 64
MODEL_FAMILY_MAX_CHARS = 128
PRECISION_MAX_CHARS = 32
GPU_TYPE_MAX_CHARS = 64
COMMAND_MAX_CHARS = 4096
LABELS_MAX_COUNT = 64
LABEL_KEY_MAX_CHARS = 317
LABEL_VALUE_MAX_CHARS = 1024
SHAPES_PER_JOB_MAX = 64
ALLOWED_NODES_MAX_COUNT = 256
NODE_ID_MAX_CHARS = 253
JOB_SPEC_MAX_BYTES = 32 * 1024
PRICER_POOLS_MAX = 256
POOL_NAME_MAX_CHARS = 128
PRICER_MAX_JOBS = 200_000
PRICER_MAX_CELLS = 8_000_000
OBSERVATIONS_PER_CALL_MAX = 10_000
ERROR_QUOTE_MAX_CHARS = 64
RATE_MIN = 1e-6  # steps/s or requests/s: the smallest non-zero declared or measured rate
RATE_MAX = 1e9
LATENCY_SLO_MS_MIN = 1e-3
LATENCY_SLO_MS_MAX = 86_400_000.0
GPU_MEM_MIB_MAX = 1 << 24  # MiB per GPU
SHARE_PCT_MIN = 1.0
BATCH_SIZE_MAX = 1 << 20
TOTAL_STEPS_MAX = 10**12
MAX_SLOWDOWN_MAX = 1000.0
PRIORITY_MAX = 1000
PRICER_VALUE_MAX = 1e12
NORM_TPUT_MAX = 1.2  # largest observed normalised throughput (services/predictor/observation_rules.py says why)

_FIELD_KEY_MAX_CHARS = 32


def clip(value: object, limit: int = ERROR_QUOTE_MAX_CHARS) -> str:
    """``value`` as text for an error message: at most ``limit`` characters of it, plus its length if cut.

    >>> clip("abc"), clip("x" * 10_000, 3)
    ('abc', 'xxx…(10000 chars)')
    """
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…({len(text)} chars)"


def field_key(key: str) -> str:
    """A map key as a field-path subscript: JSON-quoted printable ASCII (it travels in gRPC metadata), its
    escaped text cut after ``_FIELD_KEY_MAX_CHARS`` characters.

    >>> field_key("team"), field_key("k" * 40)
    ('["team"]', '["kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk..."]')
    """
    parts: list[str] = []
    used = 0
    for ch in key:
        piece = json.dumps(ch, ensure_ascii=True)[1:-1]  # "\u00e9", "\"", "a"
        if used + len(piece) > _FIELD_KEY_MAX_CHARS:
            parts.append("...")
            break
        parts.append(piece)
        used += len(piece)
    return '["' + "".join(parts) + '"]'


def text_problem(value: str, limit: int) -> str | None:
    """Why ``value`` is no acceptable text field (over ``limit`` characters, or not printable), or None."""
    if len(value) > limit:
        return too_long(len(value), limit)
    if not value.isprintable():
        return "must not contain control or other non-printable characters"
    return None


def too_long(length: int, limit: int, unit: str = "characters") -> str:
    """The message of a length violation (never quotes the value)."""
    return f"must be at most {limit} {unit}, got {length}"
