"""What a node agent measures and reports to the predictor: the normalised throughput of a simulated workload
(co-located speed over the allocator's reference) and the observations it sends."""

from __future__ import annotations

import pytest

from elastico.coloc.profiles import SCALE_COUNTS
from elastico.domain import JobKind, JobSpec, TrainingWork
from services.allocator.estimate import TypeResolver
from services.node_agent.coloc import ColocationTruth
from services.node_agent.gpu import Tenant
from services.node_agent.observations import NORM_TPUT_MAX, PredictorReporter, reportable
from services.node_agent.runner import LedgerEntry

TRUTH = ColocationTruth.default()
TYPES = TRUTH.ground_truth("v100").types


def allocator_reference(model: str, batch_size: int, num_gpus: int = 1) -> float:
    """The isolated speed the allocator gives a whole-GPU shape (its type's measured speed x gang scaling)."""
    i = TypeResolver(TYPES)(JobSpec(kind=JobKind.TRAINING, model_family=model, batch_size=batch_size,
                                    training=TrainingWork(total_steps=10)))
    scale = float(TYPES.scale_tput[i][SCALE_COUNTS.index(num_gpus)])
    return float(TYPES.iso_tput_steps_s[i]) * scale


@pytest.mark.parametrize(("model", "batch_size", "gpus"), [
    ("ResNet-50", 8, (0,)),  # the probe's job: reported 4.56 (batch size 16's speed against batch size 128's)
    ("ResNet-50", 8, (0, 1)),
    ("ResNet-50", 48, (0,)),
    ("ResNet-50", 64, (0,)),  # measured: unchanged
    ("ResNet-18", 32, (0,)),
])
def test_a_lone_simulated_workload_runs_at_the_allocators_reference_speed(model, batch_size, gpus):
    steps_s, norm = TRUTH.rates([Tenant("j", model, batch_size, gpus, 100.0)], "v100")["j"]
    assert norm == 1.0
    assert steps_s / allocator_reference(model, batch_size, len(gpus)) == pytest.approx(1.0)  # the agent's norm_throughput


def test_unmeasured_batch_size_without_a_type_of_its_own_falls_back_to_the_nearest_measured():
    c = ColocationTruth([{"worker_type": "v100", "model": "ResNet-18", "batch_size": "32", "scale_factor": "1",
                          "isolated_tput": "30"}])
    assert c.isolated("ResNet-18", 48, "v100") == 30.0


def entry(job_id: str, norm: float | None, model: str = "ResNet-50") -> LedgerEntry:
    return LedgerEntry(job_id=job_id, placement_id="p", placement=None, gpu_indices=(0,), compute_share_pct=50.0,
                       mem_mib=1024, workdir="/nonexistent", status="running", norm_throughput=norm, model=model,
                       batch_size=32)


@pytest.mark.parametrize(("norm", "model", "ok"), [
    (0.8, "ResNet-50", True), (NORM_TPUT_MAX, "ResNet-50", True), (1.0001, "ResNet-50", True),
    (4.56, "ResNet-50", False), (0.0, "ResNet-50", False), (None, "ResNet-50", False), (float("nan"), "ResNet-50", False),
    (0.8, "", False), (0.8, "\x1b[31mEvil", False),
])
def test_only_measurements_the_predictor_accepts_are_reportable(norm, model, ok):
    assert reportable(entry("a", norm, model)) is ok


class FakeStub:
    def __init__(self) -> None:
        self.requests = []

    async def ReportObservation(self, request, timeout):
        self.requests.append(request)
        return type("Resp", (), {"accepted": len(request.observations)})()

    async def close(self) -> None:
        return None


async def test_reporter_skips_pairs_out_of_range_and_sends_the_rest_unclamped():
    reporter = PredictorReporter("127.0.0.1:1", "v100")
    await reporter.close()
    reporter._stub = stub = FakeStub()
    await reporter([(entry("a", 1.1), entry("b", 0.5), "node-1"), (entry("c", 4.56), entry("d", 0.5), "node-1")])
    (req,) = stub.requests
    assert [(o.a.job_id, o.norm_tput_a, o.norm_tput_b) for o in req.observations] == [("a", 1.1, 0.5)]
    await reporter([(entry("c", 4.56), entry("d", 0.5), "node-1")])
    assert len(stub.requests) == 1 and reporter.sent == 1  # nothing left to send: no call
