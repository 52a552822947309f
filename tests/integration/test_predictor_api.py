"""Predictor over gRPC against a real redis-server: predictions, validation, and online learning."""

from __future__ import annotations

import math
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from elastico.rpc.server import ServiceBinding, create_server
from elastico.v1 import predictor_pb2 as prpb
from elastico.v1 import predictor_pb2_grpc
from elastico.v1 import types_pb2 as pb
from services.predictor import observations as obslog
from services.predictor.features import JobProfile, Observation
from services.predictor.model import InterferenceModel, train_model
from services.predictor.observations import RedisObservationLog
from services.predictor.servicer import PredictorServicer
from services.predictor.settings import PredictorSettings
from services.predictor.train import training_rows


@pytest.fixture(scope="module")
def base_model() -> InterferenceModel:
    return train_model(training_rows(include_lucid=False), seed=0)


@pytest.fixture
async def served(redis_server, base_model, tmp_path) -> AsyncIterator[tuple[predictor_pb2_grpc.PredictorStub, PredictorServicer]]:
    settings = PredictorSettings.from_env({}, insecure=True, port=0, model_path=str(tmp_path / "model.json"), max_batch_pairs=300,
                                          redis_url=redis_server.url, refresh_interval_s=0, state_dir=str(tmp_path / "state"))
    log = RedisObservationLog(redis_server.url, namespace=f"pred-{uuid.uuid4().hex[:8]}")
    servicer = PredictorServicer(settings, base_model, log)
    server, port = await create_server(settings, [ServiceBinding("elastico.v1.Predictor", servicer, predictor_pb2_grpc.add_PredictorServicer_to_server)])
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        yield predictor_pb2_grpc.PredictorStub(ch), servicer
    await server.stop(0)
    await log.close()


def prof(family: str = "ResNet-50", batch: int = 64, gpu: str = "v100", **kw) -> prpb.TaskProfile:
    return prpb.TaskProfile(model_family=family, batch_size=batch, gpu_type=gpu, kind=pb.JOB_KIND_TRAINING, **kw)


async def test_predicts_batches_symmetrically_with_model_version(served):
    stub, servicer = served
    a, b = prof("ResNet-50", 64), prof("Transformer", 32)
    resp = await stub.PredictInterference(prpb.PredictInterferenceRequest(pairs=[prpb.PairQuery(a=a, b=b), prpb.PairQuery(a=b, b=a)]), timeout=20)
    p, q = resp.predictions
    assert resp.model_version == servicer.model.version
    assert 0 <= p.norm_tput_a <= 1 and 0 <= p.norm_tput_b <= 1
    assert (p.norm_tput_a, p.norm_tput_b) == pytest.approx((q.norm_tput_b, q.norm_tput_a))


async def test_unknown_family_or_gpu_is_answered_low_confidence(served):
    stub, _ = served
    pairs = [prpb.PairQuery(a=prof("NeverSeenNet", 8), b=prof("ResNet-18", 32)),
             prpb.PairQuery(a=prof(gpu="b300"), b=prof("ResNet-18", 32, gpu="b300")),
             prpb.PairQuery(a=prof(), b=prof("ResNet-18", 32))]
    resp = await stub.PredictInterference(prpb.PredictInterferenceRequest(pairs=pairs), timeout=20)
    assert [p.low_confidence for p in resp.predictions] == [True, True, False]
    assert all(math.isfinite(p.norm_tput_a) for p in resp.predictions)


BAD = [
    ([], "pairs"),
    ([prpb.PairQuery(a=prof(mps_share_pct=math.nan), b=prof())], "pairs[0].a.mps_share_pct"),
    ([prpb.PairQuery(a=prof(), b=prof(mps_share_pct=150))], "pairs[0].b.mps_share_pct"),
    ([prpb.PairQuery(a=prof(), b=prof()), prpb.PairQuery(a=prof(family=""), b=prof())], "pairs[1].a.model_family"),
    ([prpb.PairQuery(a=prof(), b=prof(gpu="k80"))], "pairs[0].b.gpu_type"),
    ([prpb.PairQuery(a=prof(counters=pb.GpuCounters(sm_util_pct=140)), b=prof())], "pairs[0].a.counters.sm_util_pct"),
    ([prpb.PairQuery(a=prof(), b=prof())] * 301, "pairs"),
    # model families and GPU types that canonicalise to nothing (were INTERNAL)
    ([prpb.PairQuery(a=prof(family="---"), b=prof())], "pairs[0].a.model_family"),
    ([prpb.PairQuery(a=prof(), b=prof(family="\x00"))], "pairs[0].b.model_family"),
    ([prpb.PairQuery(a=prof(gpu="---"), b=prof(gpu="---"))], "pairs[0].a.gpu_type"),
    ([prpb.PairQuery(a=prof(gpu="NVIDIA"), b=prof(gpu="NVIDIA"))], "pairs[0].a.gpu_type"),
    # size limits (elastico.limits): the message never quotes the value
    ([prpb.PairQuery(a=prof(family="x" * 10_000), b=prof())], "pairs[0].a.model_family"),
    ([prpb.PairQuery(a=prof(precision="x" * 10_000), b=prof())], "pairs[0].a.precision"),
    ([prpb.PairQuery(a=prof(), b=prof(gpu="x" * 10_000))], "pairs[0].b.gpu_type"),
    ([prpb.PairQuery(a=prof(), b=prof(job_id="x" * 10_000))], "pairs[0].b.job_id"),
    # what observations must be, queries must be too (a probe sent these; they were answered)
    ([prpb.PairQuery(a=prof(family="ResNet\x1b[31m"), b=prof())], "pairs[0].a.model_family"),
    ([prpb.PairQuery(a=prof(), b=prof(precision="fp\u202e32"))], "pairs[0].b.precision"),
    ([prpb.PairQuery(a=prof(), b=prof(counters=pb.GpuCounters(mem_used_mib=math.nan)))], "pairs[0].b.counters.mem_used_mib"),
]


@pytest.mark.parametrize(("pairs", "field"), BAD, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD)])
async def test_malformed_predict_is_invalid_argument(served, pairs, field):
    stub, _ = served
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.PredictInterference(prpb.PredictInterferenceRequest(pairs=pairs), timeout=20)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details().startswith(field + ":"), exc.value.details()
    assert len(exc.value.details()) <= 200 and "x" * 65 not in exc.value.details()


def obs(a: prpb.TaskProfile | None = None, **kw) -> prpb.Observation:
    return prpb.Observation(**{"a": a or prof(), "b": prof("ResNet-18", 32), "norm_tput_a": 0.5, "norm_tput_b": 0.6,
                               "node_id": "n1", **kw})


BAD_OBSERVATIONS = [
    ([obs(), obs(prof(family="---"))], "observations[1].a.model_family"),
    ([obs(node_id="n" * 254)], "observations[0].node_id"),
    ([obs(prof(family="x" * 10_000))], "observations[0].a.model_family"),
    ([obs()] * 10_001, "observations"),
    # the probe's junk (each was accepted, then trained the model)
    ([obs(), obs(time_unix_s=math.nan)], "observations[1].time_unix_s"),
    ([obs(time_unix_s=1e300)], "observations[0].time_unix_s"),
    ([obs(time_unix_s=time.time() + 3600)], "observations[0].time_unix_s"),
    ([obs(time_unix_s=time.time() - 2 * 86400)], "observations[0].time_unix_s"),
    ([obs(norm_tput_a=0.0)], "observations[0].norm_tput_a"),
    ([obs(norm_tput_b=1.5)], "observations[0].norm_tput_b"),
    ([obs(prof(family="\x1b[31mEvil\x00"))], "observations[0].a.model_family"),
    # every other field
    ([obs(node_id="")], "observations[0].node_id"),
    ([obs(node_id="n1\n")], "observations[0].node_id"),
    ([obs(norm_tput_a=math.inf)], "observations[0].norm_tput_a"),
    ([obs(norm_tput_b=-0.1)], "observations[0].norm_tput_b"),
    ([obs(prof(job_id="j\x1b"))], "observations[0].a.job_id"),
    ([obs(prof(gpu="v100\x00"))], "observations[0].a.gpu_type"),
    ([obs(prof(precision="fp32\x07"))], "observations[0].a.precision"),
    ([obs(prof(batch=(1 << 20) + 1))], "observations[0].a.batch_size"),
    ([obs(prof(counters=pb.GpuCounters(mem_used_mib=math.nan)))], "observations[0].a.counters.mem_used_mib"),
    ([obs(prof(counters=pb.GpuCounters(mem_used_mib=1e300)))], "observations[0].a.counters.mem_used_mib"),
]


@pytest.mark.parametrize(("observations", "field"), BAD_OBSERVATIONS, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD_OBSERVATIONS)])
async def test_oversized_or_unusable_observations_are_invalid_and_nothing_is_stored(served, observations, field):
    stub, _ = served
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.ReportObservation(prpb.ReportObservationRequest(observations=observations), timeout=10)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details().startswith(field + ":") and len(exc.value.details()) <= 200, exc.value.details()[:300]
    assert (await stub.GetModelInfo(prpb.GetModelInfoRequest(), timeout=5)).pending_observations == 0


async def test_malformed_observations_are_rejected_and_nothing_is_stored(served):
    stub, _ = served
    good = obs()
    bad = obs(norm_tput_a=math.nan)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await stub.ReportObservation(prpb.ReportObservationRequest(observations=[good, bad]), timeout=5)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and exc.value.details().startswith("observations[1].norm_tput_a:")
    info = await stub.GetModelInfo(prpb.GetModelInfoRequest(), timeout=5)
    assert info.pending_observations == 0


async def test_observations_of_a_badly_predicted_pair_reduce_its_error_after_refresh(served):
    stub, servicer = served
    pair = prpb.PairQuery(a=prof("ResNet-50", 64), b=prof("ResNet-18", 32))
    before = (await stub.PredictInterference(prpb.PredictInterferenceRequest(pairs=[pair]), timeout=20)).predictions[0]
    truth_a = before.norm_tput_a - 0.35 if before.norm_tput_a > 0.5 else before.norm_tput_a + 0.35
    truth_b = before.norm_tput_b - 0.35 if before.norm_tput_b > 0.5 else before.norm_tput_b + 0.35
    obs = [prpb.Observation(a=pair.a, b=pair.b, norm_tput_a=truth_a, norm_tput_b=truth_b, node_id="n1") for _ in range(30)]
    assert (await stub.ReportObservation(prpb.ReportObservationRequest(observations=obs), timeout=5)).accepted == 30
    info = await stub.GetModelInfo(prpb.GetModelInfoRequest(), timeout=5)
    assert info.pending_observations == 30
    old_version = info.model_version
    assert await servicer.refresh(force=True)
    after_resp = await stub.PredictInterference(prpb.PredictInterferenceRequest(pairs=[pair]), timeout=20)
    after = after_resp.predictions[0]
    err_before = abs(before.norm_tput_a - truth_a) + abs(before.norm_tput_b - truth_b)
    err_after = abs(after.norm_tput_a - truth_a) + abs(after.norm_tput_b - truth_b)
    assert err_after < 0.5 * err_before, (err_before, err_after)
    assert after_resp.model_version != old_version
    info = await stub.GetModelInfo(prpb.GetModelInfoRequest(), timeout=5)
    assert info.pending_observations == 0 and info.model_version == after_resp.model_version
    assert InterferenceModel.load(servicer._settings.effective_refreshed_model_path).version == after_resp.model_version
    assert not await servicer.refresh()  # nothing new: no retrain


async def test_honest_edge_values_are_accepted(served):
    stub, _ = served
    now = time.time()
    honest = [obs(norm_tput_a=1.2, norm_tput_b=0.01), obs(time_unix_s=now - 60), obs(time_unix_s=now + 60), obs(time_unix_s=0)]
    assert (await stub.ReportObservation(prpb.ReportObservationRequest(observations=honest), timeout=5)).accepted == 4


async def test_observations_the_model_cannot_learn_from_are_dropped_not_refused(served):
    """A family the model was not trained on, or a GPU type outside the schema: answered OK, not logged."""
    stub, _ = served
    unknown = [obs(), obs(prof("NeverSeenNet", 8)), obs(prof(gpu="b300"), b=prof("ResNet-18", 32, gpu="b300"))]
    assert (await stub.ReportObservation(prpb.ReportObservationRequest(observations=unknown), timeout=5)).accepted == 1
    assert (await stub.GetModelInfo(prpb.GetModelInfoRequest(), timeout=5)).pending_observations == 1


async def test_refresh_writes_its_own_file_and_keeps_junk_out_of_the_model(served):
    stub, servicer = served
    shipped = Path(servicer._settings.model_path)
    shipped.write_bytes(b"the shipped artifact: read only")
    # junk logged before the API checked it: kept out of training at retrain
    junk = Observation(JobProfile("\x1b[31mEvil\x00", "v100", 32), JobProfile("ResNet-50", "v100", 32), 1.5, 0.0,
                       source="observation")
    await servicer._log.append([obslog.encode(junk, "node-1", math.nan)] * 9)
    good = [obs(norm_tput_a=0.4 + i / 100) for i in range(25)]
    assert (await stub.ReportObservation(prpb.ReportObservationRequest(observations=good), timeout=5)).accepted == 25
    assert await servicer.refresh(force=True)
    assert shipped.read_bytes() == b"the shipped artifact: read only"
    refreshed = servicer._settings.effective_refreshed_model_path
    assert refreshed.parent == Path(servicer._settings.state_dir)
    assert os.stat(refreshed).st_mode & 0o777 == 0o600 and os.stat(refreshed.parent).st_mode & 0o777 == 0o700
    assert InterferenceModel.load(refreshed).version == servicer.model.version
    assert not {f for f in servicer.model.meta["families_seen"] if "evil" in f or "31m" in f}
    assert servicer.model.meta["training_rows"] == len(servicer._base_rows) + 25


async def test_a_node_flooding_observations_counts_its_newest_rows_within_caps(served):
    """A node (or its stolen certificate) flooding observations counts its newest 32 rows per pair and 100 in
    all at a retrain (a probe's 88,840 forged rows took a 64-s, 1-GB retrain and set every prediction to 0.01);
    another node's honest rows are all learnt."""
    stub, servicer = served
    spread = [obs(prof("ResNet-50", 8 + k), norm_tput_a=0.01, norm_tput_b=0.01, node_id="evil")
              for k in range(40) for _ in range(20)]  # 800 rows over 40 pairs
    forged = [obs(norm_tput_a=0.01, norm_tput_b=0.01, node_id="evil")] * 5000
    honest = [obs(prof("ResNet-18", 16), node_id="good")] * 30
    for batch in (spread, forged, honest):  # oldest first
        assert (await stub.ReportObservation(prpb.ReportObservationRequest(observations=batch), timeout=20)).accepted == len(batch)
    assert await servicer.refresh(force=True)
    assert servicer.model.meta["training_rows"] == len(servicer._base_rows) + 100 + 30
