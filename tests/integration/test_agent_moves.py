"""Node agents move inference services make-before-break and relaunch co-tenants before a service grows into
their share (memory store, real processes, real HTTP; two reconcilers play two nodes).

The tests play the allocator with the store's own primitives: ``move_services`` puts the new placement under
the job id and keeps the previous one under ``drain_key(job)``, ``finish_moves`` drops the drain key.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
from structlog.testing import capture_logs

from elastico.domain import (
    GpuSlice,
    InferenceWork,
    JobKind,
    JobState,
    MetricsEndpoint,
    Placement,
    Shape,
    StateReason,
    Workload,
    drain_key,
    placement_id,
)
from elastico.state.memory import MemoryStore
from elastico.tasks import cancel_until_done
from services.node_agent.mps import SimulatedMps
from services.node_agent.reconcile import Reconciler
from services.node_agent.runner import kill_tagged, proc_start_ticks
from services.node_agent.settings import NodeAgentSettings, WorkloadPolicy
from services.node_agent.simulated import SimulatedBackend
from tests.conftest import make_job, make_node, make_spec, reachable_dir
from tests.integration.test_node_agent_process import synthetic_workload_env

SCALE = 2.0  # the simulated GPUs' accelerated clock
NODES = ("n1", "n2")


def new_agent(store: MemoryStore, node: str, state: Path, policy: WorkloadPolicy) -> Reconciler:
    return Reconciler(store, SimulatedBackend(node, "v100", 1, 16384, time_scale=SCALE),
                      SimulatedMps(state / "mps" / "pipe", state / "mps" / "log"), node, state, stop_grace_s=1.0,
                      policy=policy)


@pytest.fixture
async def cluster() -> AsyncIterator[dict]:
    with reachable_dir() as root:  # workloads run as `nobody` when the tests run as root
        store = MemoryStore()
        states = {n: (root / n).resolve() for n in NODES}
        policy = NodeAgentSettings.from_env({**synthetic_workload_env(), "ELASTICO_INSECURE": "1",
                                             "ELASTICO_STATE_DIR": str(states["n1"]),
                                             "ELASTICO_REDIS_URL": "redis://127.0.0.1:6379/0"}).workload_policy
        agents = {}
        for n in NODES:
            await store.put_node(make_node(n, gpus=1))
            agents[n] = new_agent(store, n, states[n], policy)
            await agents[n].recover()
        http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        c = {"store": store, "agents": agents, "states": states, "policy": policy, "http": http,
             "epoch": await store.acquire_leadership("alloc", 60)}
        try:
            yield c
        finally:
            await http.close()
            for r in c["agents"].values():
                await r.aclose()
            for s in c["states"].values():
                kill_tagged(str(s))
            await store.close()


def alive(pid: int) -> bool:
    return pid > 0 and proc_start_ticks(pid) is not None


def slice_placement(node: str, share: float, throughput: float = 100.0) -> Placement:
    shape = Shape(num_gpus=1, compute_share_pct=share, mem_mib=1024, throughput=throughput)
    return Placement("", 0, shape, (GpuSlice(node, 0, share, 1024),))


async def running_service(c: dict, node: str = "n1"):
    """A built-in inference service placed on ``node``, started, serving and marked RUNNING (as the allocator
    would on the agent's report)."""
    store = c["store"]
    spec = make_spec(JobKind.INFERENCE, model_family="ResNet-50",
                     inference=InferenceWork(demand_rps=50.0, latency_slo_ms=100.0, metrics=MetricsEndpoint(scrape_interval_s=0.3)))
    job, _ = await store.create_job(make_job(spec=spec))
    [job] = await store.commit_placements(c["epoch"], [(job, slice_placement(node, 40.0))])
    assert (await c["agents"][node].reconcile()).started == 1
    w = (await store.get_workloads(node))[1][job.job_id]
    await wait_healthy(c["http"], w.endpoint)
    return await store.update_job(job, replace(job, state=JobState.RUNNING, reason=StateReason.STARTED))


async def healthy(http: aiohttp.ClientSession, endpoint: str) -> bool:
    try:
        async with http.get(f"http://{endpoint}/healthz") as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def wait_healthy(http: aiohttp.ClientSession, endpoint: str) -> None:
    for _ in range(300):
        if await healthy(http, endpoint):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{endpoint} never became healthy")


async def replicas(c: dict, job_id: str) -> dict[str, tuple[str, Workload]]:
    """The service's replicas every node reports: ledger key (job id or drain key) -> (node, workload)."""
    out = {}
    for n in NODES:
        for key, w in (await c["store"].get_workloads(n))[1].items():
            if key in (job_id, drain_key(job_id)):
                assert key not in out, f"{key} reported by two nodes"
                out[key] = (n, w)
    return out


async def pass_all(c: dict, job_id: str) -> dict[str, tuple[str, Workload]]:
    """One pass of every agent; then at least one replica of the service must run and answer /healthz."""
    for r in c["agents"].values():
        await r.reconcile()
    reps = await replicas(c, job_id)
    serving = [k for k, (_, w) in reps.items() if w.status == "running" and alive(w.pid) and await healthy(c["http"], w.endpoint)]
    assert serving, f"no replica of {job_id} serving: {reps}"
    return reps


async def until_running(c: dict, job_id: str) -> dict[str, tuple[str, Workload]]:
    """Passes until the service's current replica reports "running" (its endpoint answered a scrape)."""
    for _ in range(100):
        for r in c["agents"].values():
            await r.reconcile()
        reps = await replicas(c, job_id)
        if job_id in reps and reps[job_id][1].status == "running" and await healthy(c["http"], reps[job_id][1].endpoint):
            return reps
        await asyncio.sleep(0.05)
    raise AssertionError(f"{job_id} never reported running: {reps}")


@pytest.mark.parametrize("target", ["n1", "n2"])
async def test_a_service_moves_make_before_break(cluster, target):
    c, store = cluster, cluster["store"]
    job = await running_service(c)
    key = drain_key(job.job_id)
    before = (await store.get_workloads("n1"))[1][job.job_id]
    old_pid, old_endpoint, old_id = before.pid, before.endpoint, before.placement_id
    [moving] = await store.move_services(c["epoch"], [(job, slice_placement(target, 50.0, 125.0), "move")])
    new_id = placement_id(moving.placement)

    with capture_logs() as logs:
        reps = await pass_all(c, job.job_id)
        # both replicas run: the old one, same process, reported under the drain key on n1; the new one under the job
        assert set(reps) == {job.job_id, key}
        node, old = reps[key]
        assert (node, old.pid, old.placement_id, old.status, old.endpoint) == ("n1", old_pid, old_id, "running", old_endpoint)
        node, new = reps[job.job_id]
        # the new replica is "starting" until its endpoint answers a scrape: the allocator finishes the move only then
        assert (node, new.placement_id, new.status, new.compute_share_pct) == (target, new_id, "starting", 50.0)
        assert new.pid != old_pid and new.endpoint != old_endpoint and alive(old_pid)
        assert c["agents"]["n1"].ledger.entries[key].pid == old_pid
        await wait_healthy(c["http"], new.endpoint)
        # passes while both serve (the old one answers what is sent to it): nothing starts or stops, and only
        # the current replica's demand is reported
        deadline = time.monotonic() + 5.0
        while True:
            results = [await r.reconcile() for r in c["agents"].values()]
            assert sum(res.started + res.stopped for res in results) == 0
            reps = await replicas(c, job.job_id)
            assert reps[key][1].pid == old_pid and reps[key][1].demand is None
            assert reps[job.job_id][1].pid == new.pid and await healthy(c["http"], old_endpoint)
            if reps[job.job_id][1].demand is not None or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert reps[job.job_id][1].demand is not None and reps[job.job_id][1].demand.job_id == job.job_id
        assert reps[job.job_id][1].status == "running"
    assert not [e for e in logs if e["log_level"] in ("warning", "error")], logs

    await store.finish_moves(c["epoch"], [moving])
    reps = await pass_all(c, job.job_id)
    assert set(reps) == {job.job_id} and reps[job.job_id][1].pid == new.pid
    assert not alive(old_pid) and key not in c["agents"]["n1"].ledger.entries
    reps = await pass_all(c, job.job_id)  # level-triggered: stays so
    assert set(reps) == {job.job_id} and reps[job.job_id][1].pid == new.pid and reps[job.job_id][1].status == "running"


async def test_an_agent_restarted_mid_move_re_adopts_both_replicas(cluster):
    c, store = cluster, cluster["store"]
    job = await running_service(c)
    key = drain_key(job.job_id)
    [moving] = await store.move_services(c["epoch"], [(job, slice_placement("n1", 50.0, 125.0), "move")])
    reps = await pass_all(c, job.job_id)
    old_pid, new_pid = reps[key][1].pid, reps[job.job_id][1].pid
    ledger_path = c["states"]["n1"] / "ledger.json"
    saved = json.loads(ledger_path.read_text())
    assert sorted(e["job_id"] for e in saved["entries"]) == sorted([job.job_id, key])

    async def restart(r_old: Reconciler) -> Reconciler:
        await r_old.aclose()
        r = new_agent(store, "n1", c["states"]["n1"], c["policy"])
        c["agents"]["n1"] = r
        await r.recover()
        return r

    # 1. the agent restarts with both replicas in its ledger
    r = await restart(c["agents"]["n1"])
    assert r.ledger.entries[key].pid == old_pid and r.ledger.entries[job.job_id].pid == new_pid
    with capture_logs() as logs:
        res = await r.reconcile()
    assert (res.started, res.stopped) == (0, 0)
    assert {w.job_id: w.pid for w in res.workloads} == {key: old_pid, job.job_id: new_pid}
    assert not [e for e in logs if e["event"] == "started workload"]

    # 2. it crashed right after starting the new replica, before recording it: found by its process tag
    saved["entries"] = [e for e in saved["entries"] if e["job_id"] == key]
    ledger_path.write_text(json.dumps(saved))
    r = await restart(r)
    assert set(r.ledger.entries) == {key, job.job_id} and r.ledger.entries[job.job_id].pid == new_pid
    for _ in range(3):
        reps = await pass_all(c, job.job_id)
        assert {k: w.pid for k, (_, w) in reps.items()} == {key: old_pid, job.job_id: new_pid}
    reps = await until_running(c, job.job_id)  # a restarted agent reports it serving again after its first scrape
    await wait_healthy(c["http"], reps[job.job_id][1].endpoint)  # the re-adopted new replica serves

    await store.finish_moves(c["epoch"], [moving])
    reps = await pass_all(c, job.job_id)
    assert {k: w.pid for k, (_, w) in reps.items()} == {job.job_id: new_pid} and not alive(old_pid)


async def test_a_second_move_seen_in_the_same_pass_as_the_first_ones_end(cluster):
    """The agent misses a generation: the first move finished and a second began before its next pass. The first
    replica (its drain key gone) stops, the second becomes the drain replica, the third starts."""
    c, store = cluster, cluster["store"]
    job = await running_service(c)
    key = drain_key(job.job_id)
    [moving] = await store.move_services(c["epoch"], [(job, slice_placement("n1", 30.0, 75.0), "move 1")])
    reps = await pass_all(c, job.job_id)
    first, second = reps[key][1].pid, reps[job.job_id][1].pid
    await wait_healthy(c["http"], reps[job.job_id][1].endpoint)
    [moved] = await store.finish_moves(c["epoch"], [moving])
    [moving] = await store.move_services(c["epoch"], [(moved, slice_placement("n1", 60.0, 150.0), "move 2")])
    res = await c["agents"]["n1"].reconcile()
    assert (res.started, res.stopped) == (1, 1) and not alive(first)
    by_key = {w.job_id: w for w in res.workloads}
    assert set(by_key) == {key, job.job_id} and by_key[key].pid == second and by_key[job.job_id].pid not in (first, second)
    assert by_key[job.job_id].placement_id == placement_id(moving.placement) and by_key[job.job_id].compute_share_pct == 60.0
    await wait_healthy(c["http"], by_key[job.job_id].endpoint)
    await store.finish_moves(c["epoch"], [moving])
    reps = await until_running(c, job.job_id)  # "running" once its endpoint answered a scrape
    assert {k: w.pid for k, (_, w) in reps.items()} == {job.job_id: by_key[job.job_id].pid} and not alive(second)


async def test_a_drain_entry_is_never_started(cluster):
    c, store = cluster, cluster["store"]
    job = await running_service(c)
    key = drain_key(job.job_id)
    r = c["agents"]["n1"]
    old = r.ledger.entries[job.job_id]
    [moving] = await store.move_services(c["epoch"], [(job, slice_placement("n2", 50.0, 125.0), "move")])
    r.runner.signal_group(old, signal.SIGKILL)  # the old replica dies just as the move begins
    while alive(old.pid):
        await asyncio.sleep(0.02)
    with capture_logs() as logs:
        for _ in range(3):  # its outcome stays under the drain key; it is not started again, the new replica runs
            results = [await a.reconcile() for a in c["agents"].values()]
            reps = await replicas(c, job.job_id)
            assert reps[key][1].status == "failed" and reps[key][1].placement_id == old.placement_id
            assert reps[job.job_id][0] == "n2" and reps[job.job_id][1].status in ("starting", "running")
        assert [res.started for res in results] == [0, 0]
        # a node whose agent lost its state (a reimaged node) sees a drain key naming nothing it runs: ignored
        c["states"]["n1-fresh"] = c["states"]["n1"].parent / "n1-fresh"
        fresh = new_agent(store, "n1", c["states"]["n1-fresh"], c["policy"])
        await fresh.recover()
        try:
            for _ in range(2):
                res = await fresh.reconcile()
                assert (res.started, res.workloads) == (0, ())
        finally:
            await fresh.aclose()
    assert not [e for e in logs if e["log_level"] in ("warning", "error")], logs
    await store.finish_moves(c["epoch"], [moving])
    await r.reconcile()
    assert key not in r.ledger.entries and not (await store.get_workloads("n1"))[1]


async def test_a_service_grows_into_a_relaunched_co_tenants_share_only_after_it_exited(cluster):
    c, store, r = cluster, cluster["store"], cluster["agents"]["n1"]
    svc = await running_service(c)  # 40 %, soon next to a 60 % trainer
    # a training co-tenant that ignores SIGTERM: its stop takes the full grace period (1 s) before SIGKILL
    train_spec = make_spec(command="sh -c \"trap '' TERM; while :; do sleep 0.05; done\"")
    train, _ = await store.create_job(make_job(spec=train_spec))
    [train] = await store.commit_placements(c["epoch"], [(train, slice_placement("n1", 60.0))])
    assert (await r.reconcile()).started == 1
    old = r.ledger.entries[train.job_id]
    for _ in range(100):
        old_child = r.runner.child_pid(old)
        if old_child:
            break
        await asyncio.sleep(0.05)
    assert old_child and alive(old.pid)
    svc_entry = r.ledger.entries[svc.job_id]
    rate_before = float(Path(svc_entry.rate_file).read_text())
    assert rate_before > 0

    # one generation: the trainer relaunched at 20 %, the service grown in place to 80 %
    train = await store.get_job(train.job_id)
    train = await store.release_job(c["epoch"], train, JobState.PENDING, StateReason.PREEMPTED, "relaunched smaller")
    svc = await store.get_job(svc.job_id)
    grown = replace(svc.placement, shape=replace(svc.placement.shape, compute_share_pct=80.0, throughput=160.0),
                    slices=(GpuSlice("n1", 0, 80.0, 1024),))
    await store.resize_in_place(c["epoch"], [(svc, grown, "demand grew")])
    await store.commit_placements(c["epoch"], [(train, slice_placement("n1", 20.0))])

    samples: list[tuple[float, bool]] = []  # (service rate, old trainer still alive), read outside the event loop
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            trainer_alive = alive(old.pid) or alive(old_child)
            samples.append((float(Path(svc_entry.rate_file).read_text()), trainer_alive))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        res = await r.reconcile()
    finally:
        done.set()
        sampler.join()
    assert (res.started, res.stopped, res.resized) == (1, 1, 1)
    by_job = {w.job_id: w for w in res.workloads}
    assert by_job[svc.job_id].pid == svc_entry.pid and by_job[svc.job_id].compute_share_pct == 80.0
    assert by_job[train.job_id].pid != old.pid and by_job[train.job_id].compute_share_pct == 20.0
    rate_after = float(Path(svc_entry.rate_file).read_text())
    assert rate_after > rate_before * 1.1  # twice the share (next to a co-tenant that slows it more per share)
    assert any(a for _, a in samples), "the sampler never saw the old trainer running"
    early = [rate for rate, trainer_alive in samples if trainer_alive and rate > rate_before * 1.001]
    assert not early, f"the service's larger rate was written while the old trainer still ran: {early[:3]}"
    assert samples[-1][0] == pytest.approx(rate_after)


async def test_a_start_on_another_gpu_does_not_wait_for_a_slow_stop(cluster):
    """A workload that takes its whole SIGTERM grace to exit holds up only what goes on its own GPU: in one pass,
    the job placed on the other GPU starts right after the SIGTERM, the one taking its GPU once it has exited."""
    from tests.integration.test_node_agent_process import WORKLOAD_PY

    store, epoch, state = cluster["store"], cluster["epoch"], cluster["states"]["n1"].parent / "n3"
    await store.put_node(make_node("n3", gpus=2))
    agent = Reconciler(store, SimulatedBackend("n3", "v100", 2, 16384), SimulatedMps(state / "mps" / "pipe", state / "mps" / "log"),
                       "n3", state, stop_grace_s=3.0, policy=cluster["policy"])
    cluster["agents"]["n3"], cluster["states"]["n3"] = agent, state
    await agent.recover()

    def on(gpu: int) -> Placement:
        return Placement("", 0, Shape(1, 50.0, 1024), (GpuSlice("n3", gpu, 50.0, 1024),))

    stubborn = make_spec(command=f"{WORKLOAD_PY} -c 'import signal, time; signal.signal(signal.SIGTERM, lambda *_: None); "
                                 f"print(\"ready\", flush=True); time.sleep(120)'")
    slow, _ = await store.create_job(make_job(spec=stubborn))
    [slow] = await store.commit_placements(epoch, [(slow, on(0))])
    assert (await agent.reconcile()).started == 1
    log = Path(agent.ledger.entries[slow.job_id].log_path)
    for _ in range(200):  # its SIGTERM handler is installed
        if "ready" in log.read_text():
            break
        await asyncio.sleep(0.05)
    await store.release_job(epoch, await store.get_job(slow.job_id), JobState.PENDING, StateReason.PREEMPTED)
    other, _ = await store.create_job(make_job())
    same, _ = await store.create_job(make_job())
    await store.commit_placements(epoch, [(other, on(1)), (same, on(0))])
    t0 = time.monotonic()
    sync = asyncio.create_task(agent.reconcile())
    while other.job_id not in agent.ledger.entries and not sync.done():
        await asyncio.sleep(0.02)
    took_other = time.monotonic() - t0
    assert same.job_id not in agent.ledger.entries and slow.job_id in agent.ledger.entries  # GPU 0 still stopping
    res = await sync
    took_same = time.monotonic() - t0
    assert took_other < 1.5 and took_same >= 0.8 * 3.0, (took_other, took_same)  # its shim kills it at 0.8 of the grace
    assert (res.started, res.stopped) == (2, 1) and {w.job_id for w in res.workloads} == {other.job_id, same.job_id}


async def test_a_workload_s_end_is_reported_at_once_not_at_the_next_interval(cluster):
    """The agent watches each supervisor's exit (pidfd): a pass follows an end at once, whatever the interval."""
    store, epoch, agent = cluster["store"], cluster["epoch"], cluster["agents"]["n1"]
    loop = asyncio.create_task(agent.run_forever(30.0))  # a pass now, then only when nudged (or in 30 s)
    try:
        job, _ = await store.create_job(make_job(spec=make_spec(command="sleep 1")))
        await store.commit_placements(epoch, [(job, slice_placement("n1", 50.0))])
        assert (await agent.reconcile()).started == 1
        t0 = time.monotonic()
        for _ in range(200):
            w = (await store.get_workloads("n1"))[1].get(job.job_id)
            if w is not None and w.status == "succeeded":
                break
            await asyncio.sleep(0.05)
        assert w is not None and w.status == "succeeded", w
        assert time.monotonic() - t0 < 3.0  # the command's second, and the pass its end triggered
    finally:
        await cancel_until_done([loop])


async def test_the_loop_stops_when_a_nudge_arrives_with_the_cancel(cluster):
    """A workload's end nudges the loop while the agent shuts down: the loop still ends on the one cancel (on Python
    3.11 an asyncio.wait_for around the nudge dropped it, and the agent's exit waited forever)."""
    agent = cluster["agents"]["n1"]
    passed = asyncio.Event()
    reconcile = agent.reconcile

    async def counted(*args, **kwargs):
        try:
            return await reconcile(*args, **kwargs)
        finally:
            passed.set()
    agent.reconcile = counted
    loop = asyncio.create_task(agent.run_forever(30.0))
    await passed.wait()  # the first pass is over: the loop waits for a nudge
    agent.nudge()
    loop.cancel()
    done, _ = await asyncio.wait([loop], timeout=2.0)
    assert loop in done and loop.cancelled()


async def test_desired_state_with_ids_that_are_not_path_safe_writes_nothing_outside_the_state_dir(cluster):
    """Job and placement ids name the agent's directories: desired entries whose ids would leave
    ``<state>/workloads`` (a compromised writer of desired state) are ignored, and a valid one still starts."""
    from elastico.state import codec

    c, store = cluster, cluster["store"]
    state = c["states"]["n1"]
    outside = state.parent / "escaped"
    job, _ = await store.create_job(make_job())
    good = replace(slice_placement("n1", 40.0), job_id=job.job_id, epoch=c["epoch"], committed_at_s=1.0)
    hostile = {f"../../{outside.name}": good, str(outside) + "-abs": good, "..": good, "a/../../b": good}
    store._desired.setdefault("n1", {}).update({k: codec.dumps(replace(p, job_id=k)) for k, p in hostile.items()})
    store._desired["n1"][job.job_id] = codec.dumps(good)
    store._desired_gen["n1"] = store._desired_gen.get("n1", 0) + 1
    with capture_logs() as logs:
        await c["agents"]["n1"].reconcile()
        await c["agents"]["n1"].reconcile()
    assert not outside.exists() and not Path(str(outside) + "-abs").exists()
    assert sorted(p.name for p in (state / "workloads").iterdir()) >= [job.job_id]
    assert all(p.name not in ("..", "a", "b") for p in state.parent.iterdir() if p != state)
    refused = [e["job_id"] for e in logs if e.get("event", "").startswith("desired state names a job id")]
    assert sorted(refused) == sorted([f"../../{outside.name}", str(outside) + "-abs", "..", "a/../../b"])
