"""What a reported observation must look like to be logged, and to train the model (pure: no gRPC, no I/O).

``norm_tput`` is a tenant's co-located throughput over its isolated throughput, as the node agent measures it
(progress rate over the shape's reference speed). Sharing a GPU cannot make a job faster than alone, so honest
values lie in (0, 1] plus measurement noise; :data:`NORM_TPUT_MAX` allows 20 % of it (Gavel's shipped values
never exceed 1.0, 97.5 % of Lucid's are at most 1.2). A larger value means a wrong reference speed, not
interference.

Families: the model learns only the families of its training data (``families_seen``), and GPU types the
feature schema has datasheet figures for (``KNOWN_GPUS``). An observation naming another is well-formed but is
not logged: a family learnt from a few unverified rows would enter the model's encodings (and its artifact)
unchecked. Predictions for such a family stay ``low_confidence``, answered from its other features.
"""

from __future__ import annotations

import math
from collections.abc import Container

from elastico import limits as L
from services.predictor.features import KNOWN_GPUS, Observation

NORM_TPUT_MAX = L.NORM_TPUT_MAX  # largest normalised throughput accepted (module docstring)
BATCH_SIZE_MAX = L.BATCH_SIZE_MAX  # per-GPU samples per step, as a job spec's (elastico.limits)
MEM_USED_MIB_MAX = float(1 << 20)  # 1 TiB of device memory; no GPU has more


def norm_problem(value: float) -> str | None:
    """Why ``value`` is not an acceptable normalised throughput, or None."""
    if math.isfinite(value) and 0.0 < value <= NORM_TPUT_MAX:
        return None
    return f"must be in (0, {NORM_TPUT_MAX}], got {value!r}"


def time_problem(time_unix_s: float, now: float, max_age_s: float, max_future_s: float) -> str | None:
    """Why ``time_unix_s`` is not an acceptable measurement time at ``now``, or None."""
    if not math.isfinite(time_unix_s):
        return f"must be a finite Unix time, got {time_unix_s!r}"
    if time_unix_s > now + max_future_s:
        return f"must not be more than {max_future_s:g} s ahead of the predictor's clock"
    if time_unix_s < now - max_age_s:
        return f"must be within the last {max_age_s:g} s"
    return None


def learnable(obs: Observation, families: Container[str]) -> bool:
    """Whether ``obs`` may train the model: both families in ``families``, a GPU type of the feature schema,
    both normalised throughputs in range. Also applied at retrain to what the log holds (older entries)."""
    return (obs.a.model_family in families and obs.b.model_family in families and obs.a.gpu_type in KNOWN_GPUS
            and norm_problem(obs.norm_tput_a) is None and norm_problem(obs.norm_tput_b) is None)
