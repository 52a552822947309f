"""Feature schema of the interference predictor: a job's solo profile and the features of a pair.

A :class:`JobProfile` describes one job running *alone* on one GPU type: task features (model family,
batch size, precision, training/inference, GPU type, MPS compute share), hardware counters when they were
measured (GPU/SM utilisation, memory-bandwidth utilisation, memory used, tensor-pipe utilisation) and solo
throughput characteristics derived from isolated measurements. Unknown values are NaN: XGBoost routes
missing values natively, so one model serves profiles with and without counters.

The *pair* features of an ordered pair (A, B) are A's solo vector, B's solo vector and symmetric
combinations (sums, products, same-family flags, the utilisation-sum heuristic). The model appends its
learned encodings (family-pair means) to these; their column names are part of this schema too, so the
schema version covers every column the model sees.

An :class:`Observation` is one co-location measurement of two profiles. Where profiles and observations
come from (data files, the profile catalogue) is :mod:`services.predictor.datasets`.

This module is pure: numpy and the standard library only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace

import numpy as np

from elastico.domain import PRECISIONS

#: Version of the feature schema (column list and vocabularies below). Bump on any change (an environment
#: appended to KNOWN_ENVS excepted: no existing value moves); the model artifact records it and refuses to
#: load under a different version.
SCHEMA_VERSION = "pf-5"

NAN = float("nan")

# --------------------------------------------------------------------------------------------------
# Vocabularies (part of the schema version)
# --------------------------------------------------------------------------------------------------

#: Model-family aliases: names used by different sources for the same network.
#: Gavel's "LM" is its LSTM language model on Wikitext-2, the same workload as Lucid's "LSTM"; the GPU
#: campaign's "BERT-base" is Lucid's "BERT" (no shipped row used the name before: an alias added, no code moved).
_FAMILY_ALIASES = {"lm": "lstm", "resnet": "resnet50", "autoencoder": "recommendation", "bertbase": "bert"}

#: Families with a fixed categorical code. Unknown families get NaN (and low confidence).
KNOWN_FAMILIES: tuple[str, ...] = (
    "a3c", "bert", "cyclegan", "dcgan", "efficientnet", "lstm", "mobilenetv2", "mobilenetv3", "neumf",
    "pointnet", "ppo", "recommendation", "resnet18", "resnet50", "td3", "transformer", "vgg",
    "gpt2", "llama", "vit", "yolo", "unet",
)

#: Coarse architecture class of a family (hand-assigned from the model names in the sources). It lets an
#: unseen family borrow from its class: an unknown CNN is more like ResNet than like an RL agent.
ARCH_CLASS: Mapping[str, str] = {
    "resnet18": "cnn", "resnet50": "cnn", "mobilenetv2": "cnn", "mobilenetv3": "cnn", "efficientnet": "cnn",
    "vgg": "cnn", "pointnet": "cnn", "yolo": "cnn", "unet": "cnn",
    "transformer": "transformer", "bert": "transformer", "gpt2": "transformer", "llama": "transformer",
    "vit": "transformer",
    "lstm": "rnn",
    "recommendation": "recsys", "neumf": "recsys",
    "a3c": "rl", "ppo": "rl", "td3": "rl",
    "cyclegan": "gan", "dcgan": "gan",
}
ARCH_CLASSES: tuple[str, ...] = ("cnn", "transformer", "rnn", "recsys", "rl", "gan")


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet figures of one GPU type (one die for the dual-die K80)."""

    mem_gib: float  # device memory, GiB
    fp32_tflops: float  # peak FP32 throughput, TFLOPS
    mem_bw_gbs: float  # peak memory bandwidth, GB/s


#: Known GPU types (vendor datasheets). Unknown types get NaN specs and low confidence.
GPU_SPECS: Mapping[str, GpuSpec] = {
    "k80": GpuSpec(12, 4.37, 240),
    "p100": GpuSpec(16, 9.3, 732),
    "v100": GpuSpec(16, 15.7, 900),
    "t4": GpuSpec(16, 8.1, 320),
    "rtx3090": GpuSpec(24, 35.6, 936),
    "a10": GpuSpec(24, 31.2, 600),
    "a100": GpuSpec(40, 19.5, 1555),
    "h100": GpuSpec(80, 67.0, 3350),
    "h200": GpuSpec(141, 67.0, 4800),
}
KNOWN_GPUS: tuple[str, ...] = tuple(GPU_SPECS)

#: Measurement environments with a categorical code. Co-location behaviour depends on the software stack
#: and the measurement method as well as on the GPU (Gavel's two campaigns of the *same* pairs disagree;
#: figures in docs/results.md), so every row carries the environment it was measured in and
#: the model keeps environments apart (see ``services.predictor.model``).
#: "" is this cluster: live requests and node-agent observations; "gavel" and "gavel-oracle" are Gavel's
#: measured and older campaigns, "lucid" is Lucid's RTX 3090 measurements, "campaign" the project's own GPU
#: campaign (``bench.gpu_campaign``: training next to training and next to inference under MPS shares).
#: Codes are positions: a new environment is appended (every existing code, hence every row an artifact of
#: this schema was trained on, stays as it was); reordering or removing one needs a new SCHEMA_VERSION.
KNOWN_ENVS: tuple[str, ...] = ("", "gavel", "gavel-oracle", "lucid", "campaign")

_PRECISIONS = {name: float(reduced) for name, reduced in PRECISIONS.items()}  # the model's feature: 1 = reduced


def canonical_family(name: str) -> str:
    """Canonical model-family name: lower-case alphanumerics, aliases resolved.

    >>> canonical_family("ResNet-18"), canonical_family("ResNet18"), canonical_family("LM")
    ('resnet18', 'resnet18', 'lstm')
    """
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    return _FAMILY_ALIASES.get(key, key)


def canonical_gpu(name: str) -> str:
    """Canonical GPU type: lower-case alphanumerics, vendor prefixes dropped ("Tesla V100" -> "v100")."""
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    for prefix in ("nvidia", "tesla", "geforce"):
        if key.startswith(prefix):
            key = key[len(prefix):]
    key = re.sub(r"(sxm\d?|pcie)(\d+gb)?$", "", key)
    return {"3090": "rtx3090"}.get(key, key)


def canonical_precision(name: str) -> str:
    """"fp32", "amp" (any mixed/half precision) or "" (unknown)."""
    key = name.strip().lower()
    if not key:
        return ""
    if key in ("0", "false") or _PRECISIONS.get(key) == 0.0:
        return "fp32"
    if key in ("1", "true") or _PRECISIONS.get(key) == 1.0:
        return "amp"
    raise ValueError(f"precision: unknown value {name!r} (expected one of {', '.join(PRECISIONS)}, or empty)")


# --------------------------------------------------------------------------------------------------
# Profile
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobProfile:
    """One job running alone on one GPU type. Unknown numeric values are NaN.

    Construction validates every field (``ValueError`` naming the field), so a malformed profile cannot
    reach the model. ``model_family``, ``gpu_type`` and ``precision`` are canonicalised.
    """

    model_family: str  # network family, e.g. "ResNet-50" (canonicalised to "resnet50")
    gpu_type: str  # GPU type the job runs on, e.g. "v100" (canonicalised)
    batch_size: int | None = None  # per-GPU batch size, samples per step; None = unknown
    precision: str = ""  # "fp32", "amp" (mixed/half) or "" = unknown
    training: bool = True  # True for training, False for inference serving
    mps_share_pct: float = 100.0  # CUDA MPS active-thread percentage, (0, 100]; 100 = no limit
    gpu_util_pct: float = NAN  # solo GPU (NVML) / SM utilisation, percent
    mem_bw_util_pct: float = NAN  # solo memory-bandwidth (NVML memory) utilisation, percent
    mem_used_mib: float = NAN  # solo device memory in use, MiB
    tensor_util_pct: float = NAN  # solo tensor-pipe activity, percent (GPM, Hopper+)
    isolated_tput_steps_s: float = NAN  # solo throughput on this GPU type, steps/s
    gpu_speedup_ratio: float = NAN  # solo throughput on the fastest / slowest measured GPU type (compute-boundness)
    rel_speed_this_gpu: float = NAN  # solo throughput here / on the fastest measured GPU type, (0, 1]
    remeasure_ratio: float = NAN  # solo throughput in a second measurement campaign / this one
    scaling_2gpu_ratio: float = NAN  # throughput on 2 GPUs of this type / on 1 (data-parallel scaling)
    scaling_8gpu_ratio: float = NAN  # throughput on 8 GPUs of this type / on 1
    unconsolidated_2gpu_ratio: float = NAN  # throughput on 2 GPUs across servers / within one server
    dataset: str = ""  # dataset name, informational only (not a feature)
    env: str = ""  # measurement environment (cluster / campaign); "" = this cluster (see KNOWN_ENVS)

    def __post_init__(self) -> None:
        if not isinstance(self.model_family, str) or not self.model_family.strip():
            raise ValueError("model_family: must be a non-empty string")
        if not isinstance(self.gpu_type, str) or not self.gpu_type.strip():
            raise ValueError("gpu_type: must be a non-empty string")
        object.__setattr__(self, "model_family", canonical_family(self.model_family))
        if not self.model_family:  # e.g. "---" or "\x00": nothing to look up or learn from
            raise ValueError("model_family: must contain a letter or digit")
        object.__setattr__(self, "gpu_type", canonical_gpu(self.gpu_type))
        object.__setattr__(self, "precision", canonical_precision(self.precision))
        if not isinstance(self.env, str):
            raise ValueError(f"env: {self.env!r} must be a string")
        object.__setattr__(self, "env", self.env.strip().lower())
        if self.batch_size is not None:
            bs = self.batch_size
            if isinstance(bs, bool) or not isinstance(bs, (int, float)) or bs != int(bs) or bs <= 0:
                raise ValueError(f"batch_size: {bs!r} must be a positive integer or None")
            object.__setattr__(self, "batch_size", int(bs))
        object.__setattr__(self, "training", bool(self.training))
        for f in fields(self):
            if not isinstance(f.default, float):
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{f.name}: {value!r} must be a number (NaN = unknown)")
            value = float(value)
            # one shared NaN object: equal profiles then compare (and hash) equal, so caches hit
            object.__setattr__(self, f.name, NAN if math.isnan(value) else value)
        share = float(self.mps_share_pct)
        if not (0.0 < share <= 100.0):  # also rejects NaN
            raise ValueError(f"mps_share_pct: {self.mps_share_pct!r} must be in (0, 100]")
        for name in ("gpu_util_pct", "mem_bw_util_pct", "tensor_util_pct"):
            value = float(getattr(self, name))
            if not (math.isnan(value) or 0.0 <= value <= 100.0):
                raise ValueError(f"{name}: {value!r} must be in [0, 100] or NaN")
        for name in ("mem_used_mib", "isolated_tput_steps_s", "gpu_speedup_ratio", "rel_speed_this_gpu",
                     "remeasure_ratio", "scaling_2gpu_ratio", "scaling_8gpu_ratio", "unconsolidated_2gpu_ratio"):
            value = float(getattr(self, name))
            if math.isinf(value) or value < 0.0:
                raise ValueError(f"{name}: {value!r} must be finite and >= 0, or NaN")

    def _fields_key(self) -> tuple:
        key = self.__dict__.get("_key")
        if key is None:
            key = tuple(getattr(self, f.name) for f in fields(self))
            object.__setattr__(self, "_key", key)
        return key

    def __hash__(self) -> int:
        # Profiles key the model's memos; hashing 19 fields on every lookup is measurable, so cache it.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(self._fields_key())
            object.__setattr__(self, "_hash", h)
        return h

    def __eq__(self, other: object) -> bool:
        # Same meaning as the generated field-by-field comparison (NaN fields share one object, so they
        # compare equal), but one comparison of cached tuples: dict lookups of equal profiles are hot.
        if self is other:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._fields_key() == other._fields_key()

    def __getstate__(self) -> dict:
        # the cached hash is process-specific (string hashing is salted): never pickle it (nor the key)
        return {k: v for k, v in self.__dict__.items() if k not in ("_hash", "_key")}

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, NAN if isinstance(v, float) and math.isnan(v) else v)

    @property
    def job_key(self) -> tuple[str, int, str, bool]:
        """Identity of the job *type*, independent of GPU: (family, batch size or 0, precision, training)."""
        return (self.model_family, self.batch_size or 0, self.precision, self.training)

    @property
    def domain(self) -> str:
        """GPU type plus measurement environment: ``"v100"`` or ``"v100@gavel-oracle"``."""
        return f"{self.gpu_type}@{self.env}" if self.env else self.gpu_type

    @property
    def arch_class(self) -> str:
        """Coarse architecture class ("cnn", "transformer", ...) or "" when the family is unknown."""
        return ARCH_CLASS.get(self.model_family, "")

    def completed_by(self, other: JobProfile) -> JobProfile:
        """A copy with every unknown (NaN / empty) field of ``self`` taken from ``other``."""
        updates = {}
        for f in fields(self):
            mine = getattr(self, f.name)
            theirs = getattr(other, f.name)
            if isinstance(mine, float) and math.isnan(mine) and not (isinstance(theirs, float) and math.isnan(theirs)):
                updates[f.name] = theirs
            elif f.name in ("precision", "dataset") and not mine and theirs:
                updates[f.name] = theirs
        return replace(self, **updates) if updates else self


# --------------------------------------------------------------------------------------------------
# Solo and pair feature vectors
# --------------------------------------------------------------------------------------------------

#: Columns of one job's solo vector.
SOLO_FEATURES: tuple[str, ...] = (
    "family_code", "arch_class_code", "log2_batch_size", "mixed_precision", "training", "mps_share_pct",
    "gpu_util_pct", "mem_bw_util_pct", "mem_used_mib", "tensor_util_pct", "mem_used_frac",
    "log_isolated_tput", "log_isolated_samples_s", "log_gpu_speedup_ratio", "log_rel_speed_this_gpu",
    "log_remeasure_ratio", "log_scaling_2gpu", "log_scaling_8gpu", "log_unconsolidated_2gpu",
)

#: Columns describing the shared GPU.
GPU_FEATURES: tuple[str, ...] = ("gpu_code", "gpu_mem_gib", "gpu_fp32_tflops", "gpu_mem_bw_gbs", "env_code")

#: Symmetric combinations of the two profiles (identical for (A, B) and (B, A)).
COMBO_FEATURES: tuple[str, ...] = (
    "same_family", "same_job", "same_arch_class", "util_sum_pct", "util_product", "mem_bw_util_sum_pct",
    "mem_used_sum_frac", "util_heuristic", "mps_share_sum_pct", "abs_log2_batch_ratio",
)

#: Encodings learned from co-location observations, filled by the model (NaN when absent). ``enc_pair_mean``
#: is the mean normalised throughput of rows like (A next to B) from the most specific level with data:
#: 0 = A's family next to B's family on this GPU type (in this environment), 1 = the same family pair on
#: any GPU type of this environment, 2 = A's architecture class next to B's class on this GPU type,
#: 3 = the class pair on any GPU type of this environment, 4 = the family pair in any environment,
#: 5 = the class pair in any environment; ``enc_pair_level`` says which. One backed-off value rather than
#: every level side by side: the coarser levels only add noise where the family pair is known.
ENCODING_FEATURES: tuple[str, ...] = ("enc_pair_mean", "enc_pair_level")

#: Full column list of an ordered pair row, in order.
PAIR_FEATURES: tuple[str, ...] = (
    GPU_FEATURES
    + tuple(f"a_{n}" for n in SOLO_FEATURES)
    + tuple(f"b_{n}" for n in SOLO_FEATURES)
    + COMBO_FEATURES
    + ENCODING_FEATURES
)

_FAMILY_CODE = {f: float(i) for i, f in enumerate(KNOWN_FAMILIES)}
_CLASS_CODE = {c: float(i) for i, c in enumerate(ARCH_CLASSES)}
_GPU_CODE = {g: float(i) for i, g in enumerate(KNOWN_GPUS)}
_ENV_CODE = {e: float(i) for i, e in enumerate(KNOWN_ENVS)}


def _raw_fields(p: JobProfile) -> tuple:
    spec = GPU_SPECS.get(p.gpu_type)
    return (_FAMILY_CODE.get(p.model_family, NAN), _CLASS_CODE.get(ARCH_CLASS.get(p.model_family, ""), NAN),
            float(p.batch_size) if p.batch_size else NAN, _PRECISIONS.get(p.precision, NAN),
            1.0 if p.training else 0.0, p.mps_share_pct, p.gpu_util_pct, p.mem_bw_util_pct, p.mem_used_mib,
            p.tensor_util_pct, spec.mem_gib * 1024.0 if spec else NAN, p.isolated_tput_steps_s,
            p.gpu_speedup_ratio, p.rel_speed_this_gpu, p.remeasure_ratio, p.scaling_2gpu_ratio,
            p.scaling_8gpu_ratio, p.unconsolidated_2gpu_ratio)


def _safe_log(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(x > 0, np.log(np.where(x > 0, x, 1.0)), np.nan)


def solo_matrix(profiles: Sequence[JobProfile]) -> np.ndarray:
    """Solo feature rows of ``profiles`` in :data:`SOLO_FEATURES` order (NaN for unknown), vectorised."""
    raw = np.array([_raw_fields(p) for p in profiles], dtype=float).reshape(len(profiles), 18)
    bs = raw[:, 2]
    out = np.empty((len(profiles), len(SOLO_FEATURES)))
    out[:, 0:2] = raw[:, 0:2]
    with np.errstate(divide="ignore", invalid="ignore"):
        out[:, 2] = np.log2(bs)
        out[:, 10] = raw[:, 8] / raw[:, 10]
    out[:, 3:10] = raw[:, 3:10]
    out[:, 11] = _safe_log(raw[:, 11])
    out[:, 12] = _safe_log(raw[:, 11] * bs)
    out[:, 13:19] = _safe_log(raw[:, 12:18])
    return out


def solo_vector(p: JobProfile) -> np.ndarray:
    """The solo feature values of ``p`` in :data:`SOLO_FEATURES` order (NaN for unknown)."""
    return solo_matrix([p])[0]


def gpu_vector(gpu_type: str, env: str = "") -> list[float]:
    """The GPU feature values in :data:`GPU_FEATURES` order (NaN for an unknown GPU type or environment)."""
    spec = GPU_SPECS.get(gpu_type)
    env_code = _ENV_CODE.get(env, NAN)
    if spec is None:
        return [NAN, NAN, NAN, NAN, env_code]
    return [_GPU_CODE[gpu_type], float(spec.mem_gib), float(spec.fp32_tflops), float(spec.mem_bw_gbs), env_code]


def util_heuristic(util_a_pct: np.ndarray, util_b_pct: np.ndarray) -> np.ndarray:
    """Time-slicing estimate of the share each tenant keeps: ``min(1, 100 / (util_a + util_b))``.

    Two jobs that together ask for at most 100% of the GPU's time lose nothing; beyond that each keeps its
    proportional share. NaN where a utilisation is unknown.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.minimum(1.0, 100.0 / np.maximum(util_a_pct + util_b_pct, 1e-9))


def same_flags(a: JobProfile, b: JobProfile) -> tuple[float, float, float]:
    """(same family, same job type, same architecture class) as 0/1 floats."""
    return (float(a.model_family == b.model_family), float(a.job_key == b.job_key),
            float(a.arch_class == b.arch_class and a.arch_class != ""))


_SOLO_COL = {name: j for j, name in enumerate(SOLO_FEATURES)}


def pair_rows(gpu: np.ndarray, solo_a: np.ndarray, solo_b: np.ndarray, same: np.ndarray,
              encodings: np.ndarray | None = None) -> np.ndarray:
    """Vectorised assembly of ordered-pair rows from precomputed parts (see :func:`pair_matrix`).

    Args:
        gpu: ``[n, len(GPU_FEATURES)]``; solo_a, solo_b: ``[n, len(SOLO_FEATURES)]``; same: ``[n, 3]``
            (:func:`same_flags`); encodings: ``[n, len(ENCODING_FEATURES)]`` or None (NaN).
    """
    n = solo_a.shape[0]

    def both(name: str) -> tuple[np.ndarray, np.ndarray]:
        j = _SOLO_COL[name]
        return solo_a[:, j], solo_b[:, j]

    ua, ub = both("gpu_util_pct")
    ma, mb = both("mem_bw_util_pct")
    fa, fb = both("mem_used_frac")
    sa, sb = both("mps_share_pct")
    ba, bb = both("log2_batch_size")
    enc = np.full((n, len(ENCODING_FEATURES)), np.nan) if encodings is None else np.asarray(encodings, float)
    if enc.shape != (n, len(ENCODING_FEATURES)):
        raise ValueError(f"encodings: shape {enc.shape} != {(n, len(ENCODING_FEATURES))}")
    out = np.empty((n, len(PAIR_FEATURES)))
    ng, ns = len(GPU_FEATURES), len(SOLO_FEATURES)
    out[:, :ng] = gpu
    out[:, ng:ng + ns] = solo_a
    out[:, ng + ns:ng + 2 * ns] = solo_b
    c = ng + 2 * ns
    out[:, c:c + 3] = same
    out[:, c + 3] = ua + ub
    out[:, c + 4] = ua * ub / 100.0
    out[:, c + 5] = ma + mb
    out[:, c + 6] = fa + fb
    out[:, c + 7] = util_heuristic(ua, ub)
    out[:, c + 8] = sa + sb
    out[:, c + 9] = np.abs(ba - bb)
    out[:, c + 10:] = enc
    return out


def pair_matrix(pairs: Sequence[tuple[JobProfile, JobProfile]],
                encodings: np.ndarray | None = None) -> np.ndarray:
    """Feature rows of ordered pairs, one row per (A, B): A is the job whose throughput is predicted.

    Args:
        pairs: ordered (A, B) profiles. Both must name the same GPU type (they share one GPU).
        encodings: optional ``[n, len(ENCODING_FEATURES)]`` learned encodings; NaN when omitted.

    Returns:
        float64 array ``[n, len(PAIR_FEATURES)]``.

    Raises:
        ValueError: when A and B name different GPU types.
    """
    n = len(pairs)
    for i, (a, b) in enumerate(pairs):
        if a.domain != b.domain:
            raise ValueError(f"pairs[{i}]: gpu_type/env differs between a ({a.domain}) and b ({b.domain})")
    solo_a = solo_matrix([a for a, _ in pairs])
    solo_b = solo_matrix([b for _, b in pairs])
    gpu = np.array([gpu_vector(a.gpu_type, a.env) for a, _ in pairs], dtype=float).reshape(n, len(GPU_FEATURES))
    same = np.array([same_flags(a, b) for a, b in pairs], dtype=float).reshape(n, 3)
    return pair_rows(gpu, solo_a, solo_b, same, encodings)


# --------------------------------------------------------------------------------------------------
# Observations (co-located measurements)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Observation:
    """One co-location measurement: A and B shared one GPU; each kept a fraction of its solo throughput."""

    a: JobProfile  # first tenant's solo profile
    b: JobProfile  # second tenant's solo profile
    norm_tput_a: float  # A's co-located / isolated throughput; NaN when the pair could not run
    norm_tput_b: float  # B's co-located / isolated throughput; NaN when the pair could not run
    failed: bool = False  # the pair could not run together (e.g. out of memory): no throughput target
    source: str = ""  # where the row came from ("gavel", "lucid", "observation"), informational

    def __post_init__(self) -> None:
        if self.a.domain != self.b.domain:
            raise ValueError(f"observation: gpu_type/env differs ({self.a.domain} vs {self.b.domain})")
        for name in ("norm_tput_a", "norm_tput_b"):
            v = float(getattr(self, name))
            if not self.failed and not (0.0 <= v <= 1.5):
                raise ValueError(f"{name}: {v!r} must be in [0, 1.5]")

    @property
    def group(self) -> tuple:
        """The unordered job-type pair, independent of GPU type: rows of one group are held out together."""
        return tuple(sorted((self.a.job_key, self.b.job_key), key=repr))
