"""Simulator: event ordering, conservation, no oversubscription, determinism, a small golden run."""

from __future__ import annotations

import csv
import heapq
from pathlib import Path

import numpy as np
import pytest

from services.allocator.policy import POLICY_NAMES, RuleEstimator, make_policy
from services.allocator.policy.view import Decision
from simulator.engine import ARRIVAL, COMPLETE, ROUND, Engine, OversubscribedError, SimConfig
from simulator.metrics import best_gang_speed, summarise, throughput_ceiling
from simulator.run import build_workload, run_policies
from simulator.traces import TraceError, redraw_job_types
from tests.unit._policy_builders import INFERENCE_TRACES, write_small_trace

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "data" / "traces" / "gavel_philly_vc_traces_seed0.csv"
INF = INFERENCE_TRACES


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory) -> Path:
    return write_small_trace(tmp_path_factory.mktemp("trace") / "small.csv")


@pytest.fixture(scope="module")
def workload(small_trace):
    return build_workload(str(small_trace), 8, [str(p) for p in INF], seed=0, load=1.5, estimator="rule")


class Checked(Engine):
    """Engine that checks GPU capacity after every round (test mode)."""

    def _round(self, t):
        super()._round(t)
        assert (self.gpu_share.sum(axis=1) <= 100.0 + 1e-6).all(), "GPU oversubscribed"
        occupied = self.gpu_job >= 0
        assert ((self.gpu_share > 0) == occupied).all()
        for j in self.running:
            assert all((self.gpu_job[g] == j).sum() == 1 for g in self.gpus[j])
            assert self.topo.gang_ok(self.gpus[j]), f"job {j} on {self.gpus[j]} breaks the topology"
            ten = self.gpu_job[self.gpus[j]]
            if self.kind[j] == 0 and (self.kind[ten[ten >= 0]] == 1).any():
                # a service never joins an unlimited training job: next to one, the policy sees the limit flag
                assert self.view_jobs.limited[j], f"job {j} next to a service without a limit"
        if self.observe:  # what a learning policy sees: each co-located job's interference, from the ground truth
            for j in self.running:
                if self.kind[j] != 0:
                    continue
                seen = []
                for g in self.gpus[j]:
                    on = self.gpu_job[g] >= 0
                    ten = self.gpu_job[g][on]
                    if len(ten) > 1:  # its speed before its own share's cap (not capping it gives exactly that)
                        others = (self.kind[ten] == 0) & (ten != j) & self.limited[ten]  # (limits they launched with)
                        sp = self.truth.speeds(self.type_idx[ten], self.gpu_share[g][on] if self.p.mps_limits else None,
                                               self.util[ten], others)
                        seen.append(sp[list(ten).index(j)])
                assert np.isnan(self.observed[j]) if not seen else np.isclose(self.observed[j], min(seen))


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_conservation_and_capacity(workload, policy):
    pol = make_policy(policy, workload.estimate, workload.truth.kappa)
    r = Checked(pol, workload.types, workload.truth, workload.train, workload.inf, SimConfig(gpus=8, node_gpus=4)).run()
    n = len(workload.train.arrival_s)
    done = ~np.isnan(r.completion_s)
    assert done.sum() == n  # every job fits 8 GPUs, so all complete; none lost
    assert (r.completion_s[done] >= r.first_start_s[done]).all()
    assert (r.first_start_s[done] >= r.arrival_s[done]).all()
    jct = r.completion_s - r.arrival_s
    # nobody beats isolated speed on its fastest allowed gang (a grown gang may beat its requested size)
    assert (jct >= r.duration_s / best_gang_speed(workload.train, workload.types) * (1 - 1e-9)).all()
    assert (r.timeline[:, 1] <= 1 + 1e-9).all() and (r.timeline[:, 2] <= 1 + 1e-9).all()
    assert 0.0 <= r.slo_ok_s <= r.slo_total_s
    s, cap = summarise(r), throughput_ceiling(workload.train, workload.types, r.window_end_s, 8, workload.inf)
    assert s["jobs_per_h_loaded"] <= cap["jobs_per_h_loaded"] + 1e-9  # no policy beats the ceiling
    assert s["work_gpu_h_per_h"] <= cap["work_gpu_h_per_h"] * (1 + 1e-9)
    assert s["eff_util"] <= cap["eff_util"] * (1 + 1e-9)
    assert s["avg_jct_h"] >= cap["avg_jct_floor_h"] * (1 - 1e-9)  # nor the JCT floor


def test_a_learning_policy_observes_the_ground_truth_interference(workload):
    """With a low floor ElastiCo co-locates training jobs; Checked asserts every round that each one's
    observed interference is the ground truth's (NaN when alone), and the policy learns from them."""
    seen = []

    class Counting(Checked):
        def _round(self, t):
            super()._round(t)
            seen.append(int(np.isfinite(self.observed).sum()))

    pol = make_policy("elastico", workload.estimate, workload.truth.kappa, train_floor=0.3)
    Counting(pol, workload.types, workload.truth, workload.train, workload.inf, SimConfig(gpus=8)).run()
    assert sum(seen) > 0 and pol.M is not workload.estimate  # readings were made and corrected the estimate
    assert np.isfinite(workload.estimate).sum() <= np.isfinite(pol.M).sum()


def test_unschedulable_jobs_are_reported_unfinished(small_trace):
    w = build_workload(str(small_trace), 2, None, load=0.5, estimator="rule")
    _, sums = run_policies(w, ["exclusive-fifo"], SimConfig(gpus=2))
    big = int((w.train.num_gpus > 2).sum())
    assert big > 0 and sums[0]["unfinished"] == big and sums[0]["completed"] == len(w.train.num_gpus) - big


@pytest.mark.parametrize("text, says", [
    ("arrival_time_s,job_type\n0,x\n", "missing column(s) num_gpus"),
    ("arrival_time_s,job_type,num_gpus,total_steps\nabc,ResNet-18 (batch size 16),1,100\n", ":2: column arrival_time_s"),
    ("arrival_time_s,job_type,num_gpus,total_steps\n0,ResNet-18 (batch size 16),-1,100\n", ":2: column num_gpus"),
    ("arrival_time_s,job_type,num_gpus\n0,ResNet-18 (batch size 16),1\n", ":2: job ? has no positive duration"),
    ("arrival_time_s,job_type,num_gpus,duration_v100_s_derived\n0,ResNet-18 (batch size 16),1,soon\n",
     ":2: column duration_v100_s_derived must be a number"),
    ("arrival_time_s,job_type,num_gpus\n", "no data rows"),
])
def test_bad_trace_is_a_clear_error_naming_line_and_column(tmp_path, text, says):
    bad = tmp_path / "bad.csv"
    bad.write_text(text)
    with pytest.raises(TraceError) as err:
        build_workload(str(bad), 8, estimator="rule")
    assert says in str(err.value) and str(bad) in str(err.value)


def test_inference_traces_without_an_instance_file_are_an_error_not_zero_services(tmp_path):
    """Profiles and pod sizes alone give no services: a run must not silently become training-only."""
    trace = write_small_trace(tmp_path / "t.csv")
    demand_only = [p for p in INFERENCE_TRACES if "instances" not in p.name]
    with pytest.raises(TraceError) as err:
        build_workload(str(trace), 16, [str(p) for p in demand_only], estimator="rule")
    assert "instance_sn" in str(err.value) and demand_only[0].name in str(err.value)
    w = build_workload(str(trace), 16, [str(p) for p in INFERENCE_TRACES], estimator="rule")
    assert w.inf is not None and len(w.inf.start_s) > 0


@pytest.mark.parametrize("role", ["trace", "inference", "pairs"])
def test_a_file_that_is_not_utf8_text_is_a_trace_error_naming_it(tmp_path, role):
    """Binary junk given as the training trace, an inference trace or the measured pairs: a TraceError naming the
    file (the commands turn it into a usage error), never a decoding error from inside the csv reader."""
    trace = write_small_trace(tmp_path / "t.csv")
    junk = tmp_path / "junk.csv"
    junk.write_bytes(b"\xff\xfe\x00\x81 not text")
    args = {"trace": (str(junk), None, None), "inference": (str(trace), [str(INFERENCE_TRACES[0]), str(junk)], None),
            "pairs": (str(trace), None, str(junk))}[role]
    with pytest.raises(TraceError, match=r"junk\.csv: not a UTF-8 text file \(byte 0"):
        build_workload(args[0], 16, args[1], estimator="rule", pairs=args[2])


def test_an_empty_inference_file_is_an_unrecognised_one(tmp_path):
    trace = write_small_trace(tmp_path / "t.csv")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(TraceError, match=r"empty\.csv: unrecognised inference trace header"):
        build_workload(str(trace), 16, [str(INFERENCE_TRACES[0]), str(tmp_path / "empty.csv")], estimator="rule")


@pytest.mark.parametrize("text, says", [("TIMESTAMP,ContextTokens\nyesterday,5\n", "TIMESTAMP is not a date"),
                                         ("TIMESTAMP,ContextTokens\n2023-11-16 18:17:03.97,5\n,6\n", ":3: TIMESTAMP"),
                                         ("TIMESTAMP,ContextTokens\n", "no requests")])
def test_a_bad_demand_profile_is_a_clear_error_naming_the_file(tmp_path, text, says):
    trace = write_small_trace(tmp_path / "t.csv")
    bad = tmp_path / "azure.csv"
    bad.write_text(text)
    inference = [str(p) for p in INFERENCE_TRACES if "azure" not in p.name] + [str(bad)]
    with pytest.raises(TraceError) as err:
        build_workload(str(trace), 16, inference, estimator="rule")
    assert says in str(err.value) and str(bad) in str(err.value)


@pytest.mark.parametrize("policy", ["exclusive-fifo", "exclusive-backfill", "lucid"])
def test_a_long_job_running_alone_is_not_a_stall(tmp_path, policy):
    """A job running alone for longer than the stall window (nothing else left to happen) still completes."""
    trace = tmp_path / "long.csv"
    days = SimConfig(gpus=8).stall_s / 86400 + 10
    trace.write_text("arrival_time_s,job_type,num_gpus,duration_v100_s_derived\n"
                     f"0,ResNet-18 (batch size 16),1,3600\n60,ResNet-18 (batch size 16),1,{days * 86400:.0f}\n")
    w = build_workload(str(trace), 8, estimator="rule")
    (r,), (s,) = run_policies(w, [policy], SimConfig(gpus=8))
    assert s["unfinished"] == 0 and r.completion_s[1] >= days * 86400


@pytest.mark.parametrize("policy", ["exclusive-fifo", "elastico"])
def test_a_quiet_gap_before_the_next_arrival_is_not_a_stall(tmp_path, policy):
    """An arrival further ahead than the stall window (a low --load spreads them so) is still simulated."""
    trace = tmp_path / "gap.csv"
    gap = SimConfig(gpus=8).stall_s + 10 * 86400
    trace.write_text("arrival_time_s,job_type,num_gpus,duration_v100_s_derived\n"
                     f"0,ResNet-18 (batch size 16),1,3600\n{gap:.0f},ResNet-18 (batch size 16),1,3600\n")
    w = build_workload(str(trace), 8, estimator="rule")
    (r,), (s,) = run_policies(w, [policy], SimConfig(gpus=8))
    assert s["unfinished"] == 0 and r.completion_s[1] > gap


def test_cli_reports_bad_trace_without_traceback(tmp_path, capsys):
    from simulator.__main__ import main

    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_time_s,job_type\n0,x\n")
    with pytest.raises(SystemExit) as ex:
        main(["--trace", str(bad), "--out", str(tmp_path / "o")])
    assert ex.value.code == 2 and "missing column(s) num_gpus" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, says", [("--gpus", "0", "--gpus: must be a finite number in [1"),
                                               ("--load", "-1", "--load: must be a finite number in (0.0"),
                                               ("--inference-fraction", "2", "--inference-fraction: must be a finite number in"),
                                               ("--train-floor", "0", "--train-floor: must be a finite number in (0.0, 1.0]"),
                                               ("--work-weight", "1.5", "--work-weight: must be a finite number in [0.0, 1.0]"),
                                               ("--load", "nan", "--load: must be a finite number in (0.0, inf), got nan"),
                                               ("--load", "inf", "--load: must be a finite number in (0.0, inf), got inf")])
def test_cli_rejects_out_of_range_options(tmp_path, capsys, flag, value, says):
    from simulator.__main__ import main

    with pytest.raises(SystemExit) as ex:
        main(["--trace", str(TRACE), "--out", str(tmp_path / "o"), flag, value])
    assert ex.value.code == 2 and says in capsys.readouterr().err


def _pairs_copy(tmp_path, edit=None) -> Path:
    """data/'s measured pairs, with ``edit(rows)`` applied, written to a temporary CSV."""
    with open(ROOT / "data" / "coloc_gavel_pairs.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    if edit:
        edit(rows)
    out = tmp_path / "pairs.csv"
    with open(out, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return out


def test_ground_truth_reads_the_given_pairs_table(tmp_path, small_trace):
    default = build_workload(str(small_trace), 8, estimator="rule")
    v100 = [i for i, r in enumerate(csv.DictReader(open(ROOT / "data" / "coloc_gavel_pairs.csv")))
            if r["gpu_type"] == "v100" and r["coloc_failed"] == "0"]

    def halve_first(rows):  # one measured v100 pair made twice as harmful, one dropped (becomes the rule)
        r = rows[v100[0]]
        r["norm_tput_a"], r["norm_tput_b"] = str(float(r["norm_tput_a"]) / 2), str(float(r["norm_tput_b"]) / 2)
        del rows[v100[1]]

    w = build_workload(str(small_trace), 8, estimator="rule", pairs=_pairs_copy(tmp_path, halve_first))
    assert w.truth.measured_pairs == default.truth.measured_pairs - 1
    changed = np.argwhere(~np.isclose(np.nan_to_num(w.truth.matrix, nan=-1), np.nan_to_num(default.truth.matrix, nan=-1)))
    assert 2 <= len(changed) <= 4  # the halved pair and the dropped one (each direction) differ, nothing else
    assert np.array_equal(w.estimate, RuleEstimator(kappa=w.truth.kappa).pair_matrix(w.types), equal_nan=True)  # policies see estimates


@pytest.mark.parametrize("edit, says", [
    (lambda rows: [r.pop("norm_tput_b") for r in rows], "lacks column(s) norm_tput_b"),
    (lambda rows: rows[-1].update(norm_tput_a="n/a", coloc_failed="0"), "norm_tput_a/norm_tput_b must be positive"),
])
def test_bad_pairs_table_is_a_clear_cli_error(tmp_path, capsys, edit, says):
    from simulator.__main__ import main

    bad = _pairs_copy(tmp_path, edit)
    with pytest.raises(SystemExit) as ex:
        main(["--trace", str(TRACE), "--pairs", str(bad), "--max-jobs", "5", "--out", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and says in err and str(bad) in err


def test_total_steps_and_unknown_types_are_mapped(tmp_path):
    tr = tmp_path / "t.csv"
    tr.write_text("arrival_time_s,job_type,model,num_gpus,total_steps\n"
                  "0,ResNet-18 (batch size 16),ResNet-18,1,1000\n10,GPT-9 (batch size 3),GPT-9,2,500\n")
    w = build_workload(str(tr), 8, estimator="rule")
    assert w.train.unknown_types == 1
    t = w.types.index("ResNet-18 (batch size 16)")
    assert w.train.duration_s[0] == pytest.approx(1000 / w.types.iso_tput_steps_s[t])


def test_redrawn_job_types_keep_arrivals_and_gpu_counts_and_deal_out_the_same_jobs(small_trace):
    base = build_workload(str(small_trace), 8, estimator="rule")
    a = build_workload(str(small_trace), 8, estimator="rule", redraw_seed=3)
    b = build_workload(str(small_trace), 8, estimator="rule", redraw_seed=3)
    c = build_workload(str(small_trace), 8, estimator="rule", redraw_seed=4)
    assert np.array_equal(a.train.arrival_s, base.train.arrival_s)
    assert np.array_equal(a.train.num_gpus, base.train.num_gpus)
    # the same (type, duration) jobs, dealt to other rows: a permutation, deterministic in its seed
    jobs = lambda w: sorted(zip(w.train.type_idx.tolist(), w.train.duration_s.tolist()))  # noqa: E731
    assert jobs(a) == jobs(base) == jobs(c)
    assert np.array_equal(a.train.type_idx, b.train.type_idx) and np.array_equal(a.train.duration_s, b.train.duration_s)
    assert not np.array_equal(a.train.type_idx, base.train.type_idx)
    assert not np.array_equal(a.train.duration_s, c.train.duration_s)


def test_redraw_moves_every_job_column_with_its_job(tmp_path):
    tr = tmp_path / "t.csv"
    tr.write_text("vc,arrival_time_s,job_type,model,batch_size,num_gpus,total_steps,duration_v100_s_derived\n"
                  + "".join(f"v{i},{i * 10},T{i},M{i},{i},{i % 3 + 1},{100 + i},{1000 + i}\n" for i in range(20)))
    rows = list(csv.DictReader(open(tr, newline="")))
    out = redraw_job_types(rows, 7)
    for r, o in zip(rows, out):
        assert (o["vc"], o["arrival_time_s"], o["num_gpus"]) == (r["vc"], r["arrival_time_s"], r["num_gpus"])
        i = int(o["job_type"][1:])  # the row whose job this row now runs: all of its job columns came along
        assert (o["model"], o["batch_size"], o["total_steps"], o["duration_v100_s_derived"]) == (
            f"M{i}", str(i), str(100 + i), str(1000 + i))
    assert sorted(o["job_type"] for o in out) == sorted(r["job_type"] for r in rows)
    assert [o["job_type"] for o in out] != [r["job_type"] for r in rows]


def test_a_bad_value_in_a_redrawn_job_names_the_line_it_came_from(tmp_path):
    tr = tmp_path / "t.csv"
    rows = [f"{i * 10},ResNet-18 (batch size 16),ResNet-18,1,{1000 + i}" for i in range(12)]
    rows[4] = "40,ResNet-18 (batch size 16),ResNet-18,1,soon"  # line 6 of the file
    tr.write_text("arrival_time_s,job_type,model,num_gpus,duration_v100_s_derived\n" + "\n".join(rows) + "\n")
    with pytest.raises(TraceError, match=r"t\.csv:6: column duration_v100_s_derived"):
        build_workload(str(tr), 8, estimator="rule")
    perm = np.random.default_rng(1).permutation(12).tolist()
    assert perm.index(4) != 4  # the bad job lands on another row
    with pytest.raises(TraceError, match=r"t\.csv:6: column duration_v100_s_derived"):
        build_workload(str(tr), 8, estimator="rule", redraw_seed=1)


def test_cli_redraw_seed_must_be_a_whole_number_at_least_zero(tmp_path, capsys):
    from simulator.__main__ import main
    with pytest.raises(SystemExit) as ex:
        main(["--trace", str(TRACE), "--out", str(tmp_path / "o"), "--redraw-types", "-1"])
    assert ex.value.code == 2 and "--redraw-types" in capsys.readouterr().err


def test_event_order_same_instant_is_arrival_then_completion_then_round():
    h = []
    for t, kind in [(5.0, ROUND), (5.0, COMPLETE), (5.0, ARRIVAL), (1.0, ROUND)]:
        heapq.heappush(h, (t, kind, len(h), -1, 0))
    order = [heapq.heappop(h)[:2] for _ in range(4)]
    assert order == [(1.0, ROUND), (5.0, ARRIVAL), (5.0, COMPLETE), (5.0, ROUND)]


def test_a_split_gang_is_refused(workload):
    class Split:
        name, mps_limits, needs_periodic_rounds = "split", False, False

        def decide(self, view):
            d = Decision()
            for j in view.pending:  # the first gang of 2-4 GPUs, across the two nodes (GPUs 0-3 and 4-7)
                n = int(view.jobs.num_gpus[j])
                if 2 <= n <= 4:
                    d.place.append((int(j), np.arange(4 - n // 2, 4 - n // 2 + n), 100.0))
                    break
            return d

    with pytest.raises(OversubscribedError, match="topology"):
        Engine(Split(), workload.types, workload.truth, workload.train, workload.inf, SimConfig(gpus=8, node_gpus=4)).run()


def test_oversubscribing_decision_is_refused(workload):
    class Greedy:
        name, mps_limits, needs_periodic_rounds = "bad", True, False

        def decide(self, view):
            d = Decision()
            for j in view.pending[:2]:
                d.place.append((int(j), np.zeros(int(view.jobs.num_gpus[j]), int), 75.0))
            return d

    with pytest.raises(OversubscribedError):
        Engine(Greedy(), workload.types, workload.truth, workload.train, workload.inf, SimConfig(gpus=8)).run()


def test_deterministic_under_seed(small_trace):
    def once(seed):
        w = build_workload(str(small_trace), 8, [str(p) for p in INF], seed=seed, load=1.0, estimator="rule")
        _, s = run_policies(w, ["elastico", "lucid"], SimConfig(gpus=8))
        return [{k: v for k, v in x.items() if k not in ("wall_s", "cpu_s")} for x in s]

    first = once(3)
    assert first == once(3)
    assert first != once(4)  # the seed does drive the draw (inference services and demand)


def test_golden_small_run(small_trace):
    """Pinned figures of a tiny training-only run: any change to the engine's semantics shows up here."""
    w = build_workload(str(small_trace), 8, None, load=1.0, estimator="rule")
    _, s = run_policies(w, ["exclusive-fifo", "exclusive-backfill"], SimConfig(gpus=8))
    got = {x["policy"]: (round(x["avg_jct_h"], 3), x["completed"]) for x in s}
    assert got == GOLDEN


GOLDEN = {"exclusive-fifo": (45.002, 60), "exclusive-backfill": (32.861, 60)}  # from a reviewed run (gangs up to 6 GPUs)


def test_decisions_pinned_bit_for_bit(workload):
    """Every policy's schedule on the small mixed workload in two nodes of four GPUs:
    rounds, restarts, allocation integral and a hash of every job's start and completion time (to the
    millisecond). A pure performance change must leave all of it as it is; a deliberate behaviour change
    updates the table (print the tuples below from a run)."""
    import hashlib

    res, _ = run_policies(workload, list(POLICY_NAMES), SimConfig(gpus=8, node_gpus=4))
    got = {}
    for r in res:
        times = np.round(np.concatenate([r.completion_s, r.first_start_s]), 3)
        digest = hashlib.sha256(np.nan_to_num(times, nan=-1.0).tobytes()).hexdigest()[:16]
        got[r.policy] = (r.rounds, r.restarts_training, r.restarts_inference, round(r.alloc_gpu_s, 1), digest)
    assert got == PINNED


PINNED = {  # (rounds, training restarts, inference restarts, allocated GPU-s, hash of start/completion times)
    "elastico": (1196, 40, 0, 1775327.6, "5ff4d26bb3811b22"),  # floor 0.7, shrink, slack, reprice 1 h, defrag; caps; unlimited
    # training; objective knob halfway
    "exclusive-fifo": (100, 0, 0, 1553750.0, "85ebe81c703612c6"),
    "exclusive-backfill": (86, 0, 0, 1778321.0, "cb06a9ea3e851a1a"),
    "tiresias": (1361, 262, 0, 1659516.5, "611dc909f5f2e7d0"),  # running first in a queue; no idle-making preemption
    "mps-equal-share": (97, 0, 0, 1732085.7, "f4feb0a58b69012b"),  # a capped tenant steals less
    "lucid": (104, 0, 0, 1612948.9, "6f5bc7d7710f7a38"),
}


def test_every_training_share_a_limit_is_elastico_before_unlimited_training(workload):
    """``unlimited_training=False`` (ELASTICO_UNLIMITED_TRAINING=0): every training share is a compute limit, and
    the schedule is bit for bit the one pinned before training without a service ran unlimited (at the objective
    knob's JCT end, the default then)."""
    import hashlib

    (r,), _ = run_policies(workload, ["elastico"], SimConfig(gpus=8, node_gpus=4),
                           {"unlimited_training": False, "work_weight": 0.0})
    times = np.round(np.concatenate([r.completion_s, r.first_start_s]), 3)
    digest = hashlib.sha256(np.nan_to_num(times, nan=-1.0).tobytes()).hexdigest()[:16]
    assert (r.rounds, r.restarts_training, r.restarts_inference, round(r.alloc_gpu_s, 1), digest) == \
        (1229, 43, 0, 1543440.6, "6bcc8d7bdcb7c70e")


def test_utilisation_is_smoothed_as_a_step_series_without_edge_dips():
    from simulator.report import _smoothed
    t = np.array([0.0, 10.0, 20.0, 30.0])
    y = np.array([0.5, 0.5, 1.0, 1.0])  # 0.5 over [0, 20), 1.0 from 20 on
    x, s = _smoothed(t, y, width=0.0)
    assert np.array_equal(x, t) and np.array_equal(s, y)  # no width: the samples as they are
    x, s = _smoothed(t, y, width=3.0, points=301)
    assert x[0] == 0.0 and x[-1] == 30.0
    assert s[0] == pytest.approx(0.5) and s[-1] == pytest.approx(1.0)  # flat ends stay flat
    assert s[100] == pytest.approx(0.5) and s[250] == pytest.approx(1.0)
    assert 0.5 < s[200] < 1.0  # the step at 20 is spread over the window
    assert np.all(np.diff(s) >= -1e-12)  # a rising step stays monotone



def test_the_predictor_estimate_names_the_data_its_model_was_trained_on(small_trace):
    """The model differs with Lucid's shared files present or not: a run says which one it used."""
    from services.predictor.estimator import PredictorEstimator

    meta = PredictorEstimator.from_artifact().model.meta
    w = build_workload(str(small_trace), 8, None, load=0.5, estimator="predictor")
    assert w.estimator_name == (f"predictor (models/interference.json: {meta['training_rows']} rows from "
                                f"{', '.join(sorted(meta['envs_seen']))})")
