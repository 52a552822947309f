"""Where the predictor's profiles and training rows come from: the data files and the profile catalogue.

* the shipped Gavel data (``data/gavel_isolated_throughputs.csv``, MIT): solo throughput of 26 training
  job types on K80/P100/V100, one and several GPUs, and a second measurement campaign
  (``data/gavel_oracle_isolated_throughputs.csv``). No counters exist for these jobs.
* Lucid's isolated profiles (``lucid_isolated_profiles.csv``; S-Lab non-commercial licence, so read from
  the shared data folder when present and never copied into the project): NVML counters on an RTX 3090.
* the project's GPU campaign (``bench.gpu_campaign``; its derived tables ``<gpu>_*.csv`` in a campaign folder,
  committed under ``data/h200/`` by a GPU session): solo profiles with NVML/GPM counters of training jobs and
  inference services (``training=False``) on that GPU, and training + training and training + inference
  pairs under MPS shares, environment ``"campaign"`` (:func:`campaign_profiles`, :func:`campaign_observations`).
* live, the node agents (counters of the running job), converted by the servicer.

:class:`ProfileCatalog` holds the profiles derived from data files and completes a live profile (fills its
unknown fields, never overrides known ones) so that a request naming only "ResNet-50, batch 64 on v100"
gets the same solo characteristics the model was trained with. :func:`read_pair_file` reads co-location
pairs in Gavel's or Lucid's schema; :func:`shipped_observations` is the training data shipped with (or
next to) the project, with the campaign's when committed.

This module is pure: the standard library, :mod:`services.predictor.features` and the campaign-table reader of
:mod:`elastico.coloc.profiles`.
"""

from __future__ import annotations

import csv
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path

from elastico.coloc.profiles import CampaignTables, TraceError, campaign_number, campaign_tables, default_campaign_dir
from services.predictor.features import NAN, JobProfile, Observation

# --------------------------------------------------------------------------------------------------
# Paths
# --------------------------------------------------------------------------------------------------

_REPO_ROOT = Path(__file__).resolve().parents[2]

#: Datasets shipped inside the project (Gavel, MIT licence in data/LICENSES/).
PROJECT_DATA_DIR = _REPO_ROOT / "data"


def shared_data_dir() -> Path:
    """The shared data folder (Lucid files live only there).

    ``ELASTICO_SHARED_DATA`` overrides; the default is ``../shared/data`` next to the repository. The folder
    may be absent: callers must check the files they need exist.
    """
    env = os.environ.get("ELASTICO_SHARED_DATA")
    if env:
        return Path(env)
    return _REPO_ROOT.parent / "shared" / "data"


# --------------------------------------------------------------------------------------------------
# Profile catalogue and data files
# --------------------------------------------------------------------------------------------------


_GAVEL_BATCH = re.compile(r"\(batch size (\d+)\)")


def parse_gavel_job_type(job_type: str) -> tuple[str, int | None]:
    """``"ResNet-18 (batch size 64)"`` -> ``("ResNet-18", 64)``; ``"A3C"`` -> ``("A3C", None)``."""
    m = _GAVEL_BATCH.search(job_type)
    family = job_type.split(" (")[0].strip()
    return family, (int(m.group(1)) if m else None)


def job_type_precision(job_type: str) -> str:
    """``"amp"`` for a campaign's bf16 job type (`` [amp]`` appended to Gavel's name), else ``"fp32"``
    (Gavel's jobs all ran in fp32)."""
    return "amp" if job_type.endswith(" [amp]") else "fp32"


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


class ProfileCatalog:
    """Solo profiles derived from data files, keyed by (family, batch size, precision, training, GPU type).

    Use :meth:`complete` to fill the unknown fields of a live profile; :meth:`gavel` and :meth:`lucid` look
    up the profile of a data-file job.
    """

    def __init__(self, profiles: Iterable[JobProfile] = ()) -> None:
        self._by_key: dict[tuple, JobProfile] = {}
        for p in profiles:
            self.add(p)

    @staticmethod
    def _key(p: JobProfile) -> tuple:
        return p.job_key + (p.gpu_type,)

    def add(self, p: JobProfile) -> None:
        """Add or replace the profile of ``p``'s job type on its GPU type."""
        self._by_key[self._key(p)] = p

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self):
        return iter(self._by_key.values())

    def get(self, model_family: str, batch_size: int | None, gpu_type: str, precision: str = "",
            training: bool = True) -> JobProfile | None:
        """The catalogued profile, or None. An unknown precision matches a catalogued fp32 entry."""
        probe = JobProfile(model_family, gpu_type, batch_size, precision, training)
        found = self._by_key.get(self._key(probe))
        if found is None and not probe.precision:
            found = self._by_key.get(self._key(replace(probe, precision="fp32")))
        return found

    def complete(self, p: JobProfile) -> JobProfile:
        """``p`` with unknown fields filled from the catalogued profile of its job type (if any).

        Known fields of ``p`` (live counters, MPS share) always win.
        """
        found = self._by_key.get(self._key(p))
        if found is None and not p.precision:
            found = self._by_key.get(self._key(replace(p, precision="fp32")))
        return p.completed_by(found) if found is not None else p

    # ---- constructors from data files -----------------------------------------------------------

    @classmethod
    def default(cls, project_data: Path | None = None, shared_data: Path | None = None,
                campaign_dir: Path | str | None = None) -> ProfileCatalog:
        """Gavel profiles from the project's data folder plus Lucid profiles when the shared folder has them,
        the campaign's committed under the data folder (``data/h200``) and those of ``campaign_dir``."""
        project_data = project_data or PROJECT_DATA_DIR
        cat = cls.from_gavel(project_data)
        lucid = (shared_data or shared_data_dir()) / "lucid_isolated_profiles.csv"
        if lucid.is_file():
            for p in lucid_profiles(lucid):
                cat.add(p)
        for folder in (default_campaign_dir(project_data), campaign_dir):
            for p in campaign_profiles(folder).values():
                cat.add(p)
        return cat

    @classmethod
    def from_gavel(cls, data_dir: Path) -> ProfileCatalog:
        """Profiles of Gavel's 26 job types on each GPU type, from its isolated-throughput files.

        Derived per job type and GPU type (solo measurements only, nothing from co-location):
        throughput (steps/s), speed-up from the slowest to the fastest GPU type (a compute-boundness
        proxy: input-bound jobs barely speed up), this GPU's speed relative to the fastest, the ratio
        between Gavel's two measurement campaigns, and data-parallel scaling on 2 and 8 GPUs (consolidated
        on one server and spread over servers). Gavel jobs ran in fp32 and are all training jobs.
        """
        iso: dict[tuple[str, str, int], float] = {}
        path = Path(data_dir) / "gavel_isolated_throughputs.csv"
        for r in _read_csv(path):
            value = float(r["isolated_tput"])
            if value > 0:  # 0 marks a configuration Gavel did not measure
                iso[(r["worker_type"], r["job_type"], int(r["scale_factor"]))] = value
        oracle: dict[tuple[str, str], float] = {}
        opath = Path(data_dir) / "gavel_oracle_isolated_throughputs.csv"
        if opath.is_file():
            for r in _read_csv(opath):
                if float(r["isolated_tput"]) > 0:
                    oracle[(r["worker_type"], r["job_type"])] = float(r["isolated_tput"])
        gpus = sorted({w for (w, _, sf) in iso if sf == 1 and "_" not in w})
        job_types = sorted({j for (_, j, _) in iso})
        cat = cls()
        for jt in job_types:
            family, bs = parse_gavel_job_type(jt)
            solo = {g: iso.get((g, jt, 1), NAN) for g in gpus}
            finite = [v for v in solo.values() if v > 0]
            fastest = max(finite) if finite else NAN
            speedup = fastest / min(finite) if finite else NAN
            for g in gpus:
                t1 = solo[g]
                t2 = iso.get((g, jt, 2), NAN)
                t8 = iso.get((g, jt, 8), NAN)
                u2 = iso.get((f"{g}_unconsolidated", jt, 2), NAN)
                cat.add(JobProfile(
                    model_family=family, gpu_type=g, batch_size=bs, precision="fp32", training=True,
                    isolated_tput_steps_s=t1, gpu_speedup_ratio=speedup, rel_speed_this_gpu=t1 / fastest,
                    remeasure_ratio=oracle.get((g, jt), NAN) / t1,
                    scaling_2gpu_ratio=t2 / t1, scaling_8gpu_ratio=t8 / t1, unconsolidated_2gpu_ratio=u2 / t2,
                ))
        return cat

    def gavel(self, job_type: str, gpu_type: str) -> JobProfile:
        """Profile of a Gavel job type (``"ResNet-18 (batch size 64)"``) on ``gpu_type``.

        Falls back to a task-features-only profile when the catalogue lacks the job type.
        """
        family, bs = parse_gavel_job_type(job_type)
        precision = job_type_precision(job_type)
        found = self.get(family, bs, gpu_type, precision)
        return found or JobProfile(family, gpu_type, bs, precision, True)

    def lucid(self, model: str, batch_size: int, amp: bool, dataset: str = "") -> JobProfile:
        """Profile of a Lucid job (RTX 3090); counters present when Lucid's isolated profiles were loaded."""
        precision = "amp" if amp else "fp32"
        found = self.get(model, batch_size, "rtx3090", precision)
        return found or JobProfile(model, "rtx3090", batch_size, precision, True, dataset=dataset)


def lucid_profiles(path: Path) -> list[JobProfile]:
    """Lucid's isolated profiles (``lucid_isolated_profiles.csv``): NVML counters on an RTX 3090.

    ``gpu_util`` and ``gmem_util`` are NVML GPU and memory utilisation (%), ``gmem`` is memory used (MiB).
    Lucid's ``speed`` column has model-specific units, so it is not used as steps/s.
    """
    out = []
    for r in _read_csv(Path(path)):
        out.append(JobProfile(
            model_family=r["model"], gpu_type="rtx3090", batch_size=int(r["batchsize"]),
            precision="amp" if r["amp"].strip() == "1" else "fp32", training=True,
            gpu_util_pct=min(100.0, float(r["gpu_util"])), mem_bw_util_pct=min(100.0, float(r["gmem_util"])),
            mem_used_mib=float(r["gmem"]), dataset=r["dataset"],
        ))
    return out


# --------------------------------------------------------------------------------------------------
# The project's GPU campaign (bench.gpu_campaign's derived tables)
# --------------------------------------------------------------------------------------------------

#: Measurement environment of the campaign's rows (``services.predictor.features.KNOWN_ENVS``).
CAMPAIGN_ENV = "campaign"

#: A campaign job type: ``"<model> (batch size <n>)[ [amp]]"`` (training) or ``"<model> serving (max batch <n>)"``.
_CAMPAIGN_TYPE = re.compile(r"^(?P<family>.+?)(?P<serving> serving)? \((?:batch size|max batch) (?P<bs>\d+)\)"
                            r"(?P<amp> \[amp\])?$")


def _pct(x: float) -> float:
    return min(100.0, x) if x >= 0 else NAN


def campaign_profiles(campaign_dir: Path | str | None) -> dict[tuple[str, str], JobProfile]:
    """Solo profiles of the campaign's jobs, keyed by (GPU type, job type as the tables name it).

    Training jobs from ``<gpu>_isolated_throughputs.csv`` (one GPU, MPS 100: steps/s, precision, counters);
    inference services (``training=False``) from the solo points of ``<gpu>_share_curves.csv`` (kind
    ``serve`` at 100 %) with the counters ``<gpu>_point_counters.csv`` sampled in that point (its label
    ``"<workload> @100"``). A service's steps/s stays unknown (its rate is requests within its SLO, not
    steps); its precision is unknown unless its name carries `` [amp]``. NVML SM activity is the profile's
    GPU utilisation. None, a missing or an empty folder: no profiles.

    Raises:
        TraceError: a table is missing or malformed (file, line and column named).
    """
    out: dict[tuple[str, str], JobProfile] = {}
    for ct in campaign_tables(campaign_dir):
        solo: dict[str, dict[str, str]] = {}
        for r in ct.rows("point_counters.csv"):
            if r["stage"] == "solo":
                solo[r["label"]] = r
        it = "isolated_throughputs.csv"
        for r in ct.rows(it):
            if r["worker_type"] == ct.gpu_type and campaign_number(ct, it, r, "scale_factor") == 1:
                out[(ct.gpu_type, r["job_type"])] = _campaign_solo(
                    ct, it, r, model_family=r["model"], batch_size=int(campaign_number(ct, it, r, "batch_size")),
                    precision=r["precision"], training=True,
                    isolated_tput_steps_s=campaign_number(ct, it, r, "isolated_tput"))
        sc = "share_curves.csv"
        for r in ct.rows(sc):
            if r["gpu_type"] == ct.gpu_type and r["kind"] == "serve" and campaign_number(ct, sc, r, "share_pct") == 100:
                base = _parsed_profile(r["job_type"], ct.gpu_type, training=False)
                c = solo.get(f"{r['workload']} @100")
                out[(ct.gpu_type, r["job_type"])] = _campaign_solo(
                    ct, "point_counters.csv" if c else sc, c or r, model_family=base.model_family,
                    batch_size=base.batch_size, precision=base.precision, training=False)
    return out


def _campaign_solo(ct: CampaignTables, table: str, row: dict[str, str], **task) -> JobProfile:
    """A campaign job's profile: ``task`` fields plus the counters of ``row`` (a row of ``table``; NaN where
    it has none)."""
    def num(col: str) -> float:
        return campaign_number(ct, table, row, col) if col in row else NAN

    try:
        return JobProfile(gpu_type=ct.gpu_type, gpu_util_pct=_pct(num("sm_util_pct")),
                          mem_bw_util_pct=_pct(num("mem_bw_util_pct")), tensor_util_pct=_pct(num("tensor_util_pct")),
                          mem_used_mib=num("mem_used_mib"), **task)
    except ValueError as exc:
        raise TraceError(f"{ct.path(table)}:{row.get('_line', '?')}: {exc}") from None


def _parsed_profile(job_type: str, gpu_type: str, training: bool) -> JobProfile:
    """Task features read from a campaign job type's name (``"GPT-2 (batch size 8) [amp]"``)."""
    m = _CAMPAIGN_TYPE.match(job_type)
    if m is None:
        return JobProfile(job_type, gpu_type, None, "", training)
    precision = "amp" if m.group("amp") else ("" if m.group("serving") else "fp32")
    return JobProfile(m.group("family"), gpu_type, int(m.group("bs")), precision, training)


def campaign_observations(campaign_dir: Path | str | None) -> list[Observation]:
    """The campaign's co-location measurements as training rows (environment ``"campaign"``).

    * training + training (``<gpu>_coloc_pairs.csv``): both tenants' normalised throughput;
    * training + inference (``<gpu>_train_infer_pairs.csv``): the training tenant's normalised throughput and
      the service's (``training=False``) capacity within its SLO relative to alone. Points with MPS client
      priorities are left out: no feature says a tenant had one.

    Every split is kept (each profile's ``mps_share_pct`` is its share: the feature that teaches the model
    what a share does). Failed points are ``failed`` rows. A value above 1 (a co-tenant cannot make a job
    faster than alone: noise, or the service's rate search stepping past its solo rate) is read as 1.
    None, a missing or an empty folder: no rows.

    Raises:
        TraceError: a table is missing or malformed (file, line and column named).
    """
    profiles = campaign_profiles(campaign_dir)
    out: list[Observation] = []
    for ct in campaign_tables(campaign_dir):
        pt = "coloc_pairs.csv"
        for r in ct.rows(pt):
            if r["gpu_type"] == ct.gpu_type:
                out.append(_campaign_row(ct, pt, r, profiles, (r["job_type_a"], "share_a_pct", "norm_tput_a", True),
                                         (r["job_type_b"], "share_b_pct", "norm_tput_b", True), "coloc_failed"))
        ti = "train_infer_pairs.csv"
        for r in ct.rows(ti):
            if r["gpu_type"] == ct.gpu_type and not (r["priority_train"] or r["priority_service"]).strip():
                out.append(_campaign_row(ct, ti, r, profiles,
                                         (r["job_type_train"], "share_train_pct", "norm_tput_train", True),
                                         (r["service"], "share_service_pct", "norm_capacity_service", False), "failed"))
    return out


def _campaign_row(ct: CampaignTables, table: str, r: dict[str, str], profiles: Mapping[tuple[str, str], JobProfile],
                  a: tuple[str, str, str, bool], b: tuple[str, str, str, bool], failed_col: str) -> Observation:
    """One observation from a campaign pair row; ``a``/``b`` = (job type, share column, value column, training)."""
    failed = r[failed_col].strip() == "1"
    tenants, ys = [], []
    for job_type, share_col, value_col, training in (a, b):
        share = campaign_number(ct, table, r, share_col)
        p = profiles.get((ct.gpu_type, job_type)) or _parsed_profile(job_type, ct.gpu_type, training)
        try:
            tenants.append(replace(p, mps_share_pct=100.0 if math.isnan(share) else share, env=CAMPAIGN_ENV))
        except ValueError as exc:
            raise TraceError(f"{ct.path(table)}:{r['_line']}: {exc}") from None
        y = campaign_number(ct, table, r, value_col)
        if not failed and not (y >= 0 and math.isfinite(y)):
            raise TraceError(f"{ct.path(table)}:{r['_line']}: column {value_col} must be a number >= 0 "
                             f"(the point did not fail), got {r[value_col]!r}")
        ys.append(NAN if failed else min(y, 1.0))
    return Observation(tenants[0], tenants[1], ys[0], ys[1], failed, CAMPAIGN_ENV)


def _extra_campaign(campaign_dir: Path | str | None) -> Path | None:
    """``campaign_dir`` unless it is the one :func:`shipped_observations` already reads (``data/h200``)."""
    if campaign_dir is None:
        return None
    shipped = default_campaign_dir(PROJECT_DATA_DIR)
    return None if shipped is not None and Path(campaign_dir).resolve() == shipped.resolve() else Path(campaign_dir)


#: Header columns that identify each pair-file schema.
GAVEL_PAIR_COLUMNS = ("gpu_type", "job_type_a", "job_type_b", "norm_tput_a", "norm_tput_b", "coloc_failed")
LUCID_PAIR_COLUMNS = ("model1", "batchsize1", "amp1", "speed1", "model2", "batchsize2", "amp2", "speed2")


def detect_pair_schema(path: Path) -> str:
    """``"gavel"`` or ``"lucid"`` from the CSV header.

    Raises:
        ValueError: when the header matches neither schema.
    """
    with open(path, newline="") as fh:
        header = next(csv.reader(fh), [])
    cols = set(header)
    if set(GAVEL_PAIR_COLUMNS) <= cols:
        return "gavel"
    if set(LUCID_PAIR_COLUMNS) <= cols:
        return "lucid"
    raise ValueError(f"{path}: header matches neither the Gavel nor the Lucid pair schema: {header[:8]}")


def _gavel_campaign(row: Mapping[str, str], a: JobProfile, b: JobProfile) -> str:
    """The Gavel campaign a pair-file row comes from, recognised by its isolated throughputs.

    The measured campaign's rows carry the isolated throughput of ``gavel_isolated_throughputs.csv`` (the
    catalogue's ``isolated_tput_steps_s``); the oracle campaign's carry ``gavel_oracle_isolated_throughputs``
    (``isolated_tput_steps_s * remeasure_ratio``). Returns "gavel" or "gavel-oracle"; rows that match
    neither (unknown job types) count as "gavel".
    """
    votes = {"gavel": 0, "gavel-oracle": 0}
    for p, col in ((a, "isolated_tput_a"), (b, "isolated_tput_b")):
        try:
            value = float(row.get(col, "") or "nan")
        except ValueError:
            continue
        measured = p.isolated_tput_steps_s
        oracle = measured * p.remeasure_ratio
        if measured > 0 and math.isclose(value, measured, rel_tol=1e-6):
            votes["gavel"] += 1
        elif oracle > 0 and math.isclose(value, oracle, rel_tol=1e-6):
            votes["gavel-oracle"] += 1
    return "gavel-oracle" if votes["gavel-oracle"] > votes["gavel"] else "gavel"


def read_pair_file(path: Path, catalog: ProfileCatalog | None = None) -> list[Observation]:
    """Observations from a pair file in the Gavel or Lucid schema (autodetected).

    Gavel rows with ``coloc_failed = 1`` become ``failed`` observations (no throughput target). Gavel rows
    whose co-located value equals the isolated one (``a/b_equals_isolated``, probably capping in Gavel's
    post-processing) are kept as measured: the cap says the job kept (at least) its solo speed. Rows of
    Gavel's older campaign (``coloc_gavel_oracle_pairs.csv`` and files like it) are recognised by their
    isolated throughputs and get ``env = "gavel-oracle"``, the others ``env = "gavel"``; Lucid rows get
    ``env = "lucid"``.
    """
    catalog = catalog if catalog is not None else ProfileCatalog.default()
    schema = detect_pair_schema(path)
    out: list[Observation] = []
    for r in _read_csv(Path(path)):
        if schema == "gavel":
            a = catalog.gavel(r["job_type_a"], r["gpu_type"])
            b = catalog.gavel(r["job_type_b"], r["gpu_type"])
            env = _gavel_campaign(r, a, b)
            a, b = replace(a, env=env), replace(b, env=env)
            failed = r["coloc_failed"].strip() == "1"
            ya = NAN if failed else float(r["norm_tput_a"])
            yb = NAN if failed else float(r["norm_tput_b"])
            out.append(Observation(a, b, ya, yb, failed, env))
        else:
            a = catalog.lucid(r["model1"], int(r["batchsize1"]), r["amp1"].strip() == "1", r.get("dataset1", ""))
            b = catalog.lucid(r["model2"], int(r["batchsize2"]), r["amp2"].strip() == "1", r.get("dataset2", ""))
            a, b = replace(a, env="lucid"), replace(b, env="lucid")
            out.append(Observation(a, b, float(r["speed1"]), float(r["speed2"]), False, "lucid"))
    return out


def shipped_observations(catalog: ProfileCatalog | None = None, include_lucid: bool = True,
                         include_oracle: bool = True, campaign_dir: Path | str | None = None) -> list[Observation]:
    """The training data shipped with (or next to) the project.

    Gavel's measured pairs (``data/coloc_gavel_pairs.csv``, environment "gavel"); Gavel's older campaign of
    the same pairs (``data/coloc_gavel_oracle_pairs.csv``, "gavel-oracle") when ``include_oracle``; Lucid's
    pairs from the shared folder (``"lucid"``) when present and ``include_lucid``; the GPU campaign's pairs
    (``"campaign"``, :func:`campaign_observations`) committed under ``data/h200`` and those of
    ``campaign_dir`` (read once when it is that folder).
    """
    catalog = catalog if catalog is not None else ProfileCatalog.default()
    rows = read_pair_file(PROJECT_DATA_DIR / "coloc_gavel_pairs.csv", catalog)
    oracle = PROJECT_DATA_DIR / "coloc_gavel_oracle_pairs.csv"
    if include_oracle and oracle.is_file():
        rows += read_pair_file(oracle, catalog)
    lucid = shared_data_dir() / "coloc_lucid_pairs.csv"
    if include_lucid and lucid.is_file():
        rows += read_pair_file(lucid, catalog)
    rows += campaign_observations(default_campaign_dir(PROJECT_DATA_DIR))
    rows += campaign_observations(_extra_campaign(campaign_dir))
    return rows
