"""The node agent as a real process on simulated GPUs, against a real redis-server.

The test plays the allocator: it commits placements through the Store (exactly what the allocator
does) and reads the node's actual state back. Workloads are real child processes; every test kills
whatever it started (agent and workloads), so no stray process survives the suite.

Run as root, the agent runs workloads as ``nobody`` (docs/security.md "Workloads"): state dirs are then
made where that user can reach them, and ``synthetic_workload_env`` says who runs the synthetic workload.
"""

from __future__ import annotations

import asyncio
import functools
import os
import pwd
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from elastico.domain import GpuSlice, JobState, Placement, Shape, StateReason, Workload
from elastico.state.redis_store import RedisStore
from services.node_agent.coloc import ColocationTruth
from services.node_agent.gpu import Tenant
from services.node_agent.mps import SimulatedMps, read_environ
from services.node_agent.runner import find_tagged, kill_tagged
from services.node_agent.settings import WorkloadPolicy, workload_python
from tests.conftest import make_job, make_spec, reachable_dir

pytestmark = pytest.mark.slow
NODE = "sim-node"
REPO = Path(__file__).resolve().parents[2]
WORKLOAD_PY = WorkloadPolicy.default().python  # an interpreter the default workload user can run
ROOT_WORKLOADS = {"ELASTICO_WORKLOAD_USER": "root", "ELASTICO_ALLOW_ROOT_WORKLOADS": "1"}


@functools.cache
def nobody_runs_python() -> bool:
    """Whether ``nobody`` can start this interpreter and import the synthetic workload from this checkout."""
    pw = pwd.getpwnam("nobody")
    try:
        res = subprocess.run([workload_python(pw.pw_uid, pw.pw_gid), "-c", "import services.node_agent.synthetic"], user=pw.pw_uid,
                             group=pw.pw_gid, extra_groups=[], cwd="/", env={"PYTHONPATH": str(REPO)}, capture_output=True)
    except PermissionError:
        return False
    return res.returncode == 0


def synthetic_workload_env() -> dict[str, str]:
    """Workload settings for tests running the synthetic (Python) workload: the default (``nobody`` when the tests
    run as root) where ``nobody`` can run this interpreter; otherwise root workloads, explicitly allowed. The
    latter happens when the interpreter lives in a directory only root may enter, e.g. a pyenv under /root (0700)."""
    return dict(ROOT_WORKLOADS) if os.getuid() == 0 and not nobody_runs_python() else {}


def agent_env(redis_url: str, state_dir: Path, **extra: str) -> dict[str, str]:
    """Environment of an agent on 2 simulated GPUs with fast loops; ``extra`` adds ELASTICO_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICO_")}
    env.update({"ELASTICO_INSECURE": "1", "ELASTICO_REDIS_URL": redis_url, "ELASTICO_REDIS_NAMESPACE": f"agent-{uuid.uuid4().hex[:8]}",
                "ELASTICO_NODE_ID": NODE,
                "ELASTICO_GPU_BACKEND": "simulated", "ELASTICO_SIM_GPU_TYPE": "v100", "ELASTICO_SIM_GPU_COUNT": "2",
                "ELASTICO_PORT": "0", "ELASTICO_STATE_DIR": str(state_dir), "ELASTICO_RECONCILE_INTERVAL_S": "0.2",
                "ELASTICO_HEARTBEAT_INTERVAL_S": "0.2", "ELASTICO_STOP_GRACE_S": "3", "ELASTICO_MPS_FAULT_HOLDDOWN_S": "0.5",
                "ELASTICO_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1", **extra})
    return env


@dataclass
class AgentProc:
    env: dict[str, str]
    state_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "services.node_agent"], env=self.env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


@pytest.fixture
def workload_env() -> dict[str, str]:
    """Workload settings of the ``agent`` fixture; a test overrides them with ``parametrize("workload_env", ...)``."""
    return synthetic_workload_env()


@pytest.fixture
async def agent(redis_server, tmp_path: Path, workload_env: dict[str, str]) -> AsyncIterator[tuple[AgentProc, RedisStore]]:
    with reachable_dir() as root:
        async with run_agent(redis_server.url, root / "state", tmp_path / "agent.log", **workload_env) as pair:
            yield pair


@asynccontextmanager
async def run_agent(redis_url: str, state_dir: Path, log_path: Path, **extra: str) -> AsyncIterator[tuple[AgentProc, RedisStore]]:
    """Start an agent; yield it and a store on its namespace; kill it and every workload it started."""
    env = agent_env(redis_url, state_dir, **extra)
    ns = env["ELASTICO_REDIS_NAMESPACE"]
    a = AgentProc(env, state_dir, log_path)
    store = RedisStore.from_url(redis_url, namespace=ns)
    a.start()
    try:
        yield a, store
    finally:
        a.stop()
        kill_tagged(str(state_dir.resolve()))
        deadline = time.monotonic() + 5
        while find_tagged(str(state_dir.resolve())) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not find_tagged(str(state_dir.resolve())), "workload processes survived clean-up"
        await store.close()


async def eventually(fn, timeout_s: float = 15.0, interval_s: float = 0.1):
    """Poll ``fn`` (async) until it returns a truthy value."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = await fn()
        if last:
            return last
        await asyncio.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s}s (last: {last!r})")


async def place(store: RedisStore, epoch: int, gpu: int, share: float, mem: int, model: str, batch: int,
                total_steps: int = 1_000_000, command: str = "") -> str:
    job, _ = await store.create_job(make_job(spec=make_spec(model_family=model, batch_size=batch, command=command,
                                                            training=make_spec().training.__class__(total_steps=total_steps))))
    shape = Shape(num_gpus=1, compute_share_pct=share, mem_mib=mem)
    await store.commit_placements(epoch, [(job, Placement("", 0, shape, (GpuSlice(NODE, gpu, share, mem),)))])
    return job.job_id


async def workloads(store: RedisStore) -> dict[str, Workload]:
    return (await store.get_workloads(NODE))[1]


def child_of(pid: int, timeout_s: float = 5.0, need: tuple[str, ...] = ("CUDA_VISIBLE_DEVICES",)) -> int:
    """The workload process under a shim, once its environment reads whole: while the child execs, /proc shows an
    empty or partial one, so wait until it has every variable of ``need`` (CUDA_VISIBLE_DEVICES, which every
    workload's environment carries, by default)."""
    deadline = time.monotonic() + timeout_s
    while True:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        env = (read_environ(int(children[0])) or {}) if len(children) == 1 else {}
        if env and all(k in env for k in need):
            return int(children[0])
        assert time.monotonic() < deadline, f"shim {pid} has children {children}; environment keys {sorted(env)}"
        time.sleep(0.05)


async def registered(store: RedisStore) -> int:
    await eventually(lambda: _node_known(store))
    epoch = await store.acquire_leadership("test-allocator", 60)
    assert epoch is not None
    return epoch


async def _node_known(store: RedisStore) -> bool:
    return NODE in [n.node_id for n in await store.list_nodes()]


async def test_mps_env_rates_and_restart_readoption(agent):
    a, store = agent
    epoch = await registered(store)
    # two tenants share GPU 0 (70 % + 30 %), one runs alone on GPU 1 (50 %)
    j_r18 = await place(store, epoch, 0, 70.0, 4096, "ResNet-18", 32)
    j_r50 = await place(store, epoch, 0, 30.0, 2048, "ResNet-50", 64)
    j_solo = await place(store, epoch, 1, 50.0, 8192, "Transformer", 64)

    async def all_running():
        w = await workloads(store)
        return w if len(w) == 3 and all(x.status == "running" for x in w.values()) else None

    w = await eventually(all_running)
    state_dir = a.state_dir.resolve()
    # exactly the MPS environment each placement asked for, on the real workload process
    for job_id, gpu, share, mem in ((j_r18, "0", "70", "0=4096M"), (j_r50, "0", "30", "0=2048M"), (j_solo, "1", "50", "0=8192M")):
        env = read_environ(child_of(w[job_id].pid))
        assert env is not None
        assert env["CUDA_VISIBLE_DEVICES"] == gpu
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == share
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == mem
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(state_dir / "mps" / "pipe")
        assert env["CUDA_MPS_LOG_DIRECTORY"] == str(state_dir / "mps" / "log")
        assert env["ELASTICO_PROGRESS_FILE"].startswith(str(state_dir))
        assert "ELASTICO_REDIS_URL" not in env  # the agent's own settings do not leak into workloads
    assert w[j_r18].cotenants == (j_r50,) and w[j_solo].cotenants == ()

    # observed progress rates follow the simulator's ground truth: measured pair, saturating share cap, and the
    # capped job stealing only the time it runs (compose_capped)
    truth = ColocationTruth.default()
    expected = truth.rates([Tenant(j_r18, "ResNet-18", 32, (0,), 70.0), Tenant(j_r50, "ResNet-50", 64, (0,), 30.0),
                            Tenant(j_solo, "Transformer", 64, (1,), 50.0)], "v100")
    gt = truth.ground_truth("v100")
    u = {n: float(gt.types.solo_util[gt.types.index(n)]) for n in
         ("ResNet-18 (batch size 32)", "ResNet-50 (batch size 64)", "Transformer (batch size 64)")}
    ia, ib = gt.types.index("ResNet-18 (batch size 32)"), gt.types.index("ResNet-50 (batch size 64)")
    na, nb = gt.matrix[ia, ib], gt.matrix[ib, ia]
    assert 0 < na < 0.7 and nb > 0.3  # measured on V100
    cap_b = min(1.0, 0.30 / u["ResNet-50 (batch size 64)"])
    assert cap_b < nb  # ResNet-50's 30 % holds it below its pace next to ResNet-18: it steals cap_b / nb of its time
    assert expected[j_r18][1] == pytest.approx(1.0 / (1.0 + cap_b / nb * (1.0 / na - 1.0)))  # below its cap 1.0
    assert expected[j_r50][1] == pytest.approx(cap_b)  # share cap binds
    # alone at 50 %: min(1, share / solo utilisation), not the linear 0.5
    assert expected[j_solo][1] == pytest.approx(min(1.0, 0.50 / u["Transformer (batch size 64)"]))
    assert expected[j_solo][1] > 0.55

    async def measured():
        w = await workloads(store)
        ok = all(w[j].throughput > 0 and abs(w[j].throughput - expected[j][0]) <= 0.1 * expected[j][0] for j in expected)
        return w if ok else None

    w = await eventually(measured, timeout_s=10)
    for j in expected:
        assert w[j].norm_throughput == pytest.approx(expected[j][1], rel=0.1)

    # kill -9 the agent while workloads run: they keep running; a restarted agent re-adopts them
    pids = {j: x.pid for j, x in w.items()}
    a.kill9()
    await asyncio.sleep(0.5)
    assert set(find_tagged(str(state_dir)).values()) == set(pids.values())  # nothing died with the agent
    a.start()

    async def readopted():
        gen, w = await store.get_workloads(NODE)
        return w if {j: x.pid for j, x in w.items() if x.status == "running"} == pids else None

    await eventually(readopted)
    await asyncio.sleep(1.0)  # several reconcile passes later: still the same processes, no duplicates
    assert set(find_tagged(str(state_dir)).values()) == set(pids.values())
    assert {j: x.pid for j, x in (await workloads(store)).items()} == pids

    # even a lost ledger (crash between starting a process and recording it) duplicates nothing:
    # the restarted agent finds its tagged processes and their launch records
    a.kill9()
    (state_dir / "ledger.json").unlink()
    a.start()
    await eventually(readopted)
    await asyncio.sleep(1.0)
    assert set(find_tagged(str(state_dir)).values()) == set(pids.values())

    # releasing a job (what the allocator does on preemption) stops exactly its process
    job = await store.get_job(j_r50)
    await store.release_job(epoch, job, JobState.PENDING, StateReason.PREEMPTED, "test")

    async def gone():
        w = await workloads(store)
        return j_r50 not in w and pids[j_r50] not in find_tagged(str(state_dir)).values()

    await eventually(gone)
    assert {j: x.pid for j, x in (await workloads(store)).items()} == {j_r18: pids[j_r18], j_solo: pids[j_solo]}


# the simulated MPS daemon finds its clients among the agent's own uid's processes (mps.find_clients), so its
# fault injection needs workloads of the agent's uid: root's when the tests run as root, else the default (an
# agent not running as root runs workloads as itself)
@pytest.mark.parametrize("workload_env", [ROOT_WORKLOADS if os.getuid() == 0 else {}], ids=["agent-uid-workloads"])
async def test_mps_fault_drains_gpu_and_reports_victims(agent):
    a, store = agent
    epoch = await registered(store)
    v1 = await place(store, epoch, 0, 50.0, 4096, "ResNet-18", 32)
    v2 = await place(store, epoch, 0, 50.0, 4096, "LM", 20)
    bystander = await place(store, epoch, 1, 100.0, 8192, "ResNet-50", 64)

    async def all_running():
        w = await workloads(store)
        return w if len(w) == 3 and all(x.status == "running" for x in w.values()) else None

    before = await eventually(all_running)
    await asyncio.sleep(0.3)  # the shims have started their workloads (MPS clients)
    SimulatedMps(a.state_dir.resolve() / "mps" / "pipe", a.state_dir.resolve() / "mps" / "log").inject_fault(0)

    async def victims_reported():
        w = await workloads(store)
        return w if all(w[j].status == "failed" for j in (v1, v2)) else None

    w = await eventually(victims_reported)
    for j in (v1, v2):
        assert w[j].reason is StateReason.COTENANT_FAULT, w[j]
        assert w[j].exit_code == -signal.SIGKILL and "MPS server fault" in w[j].message
    assert w[bystander].status == "running" and w[bystander].pid == before[bystander].pid

    async def drained():
        node = await store.get_node(NODE)
        return node if not node.gpus[0].healthy else None

    node = await eventually(drained, timeout_s=5)
    assert node.gpus[1].healthy
    # the allocator requeues the victims without penalty; the GPU then returns to service
    for j in (v1, v2):
        await store.release_job(epoch, await store.get_job(j), JobState.PENDING, StateReason.COTENANT_FAULT)

    async def healthy_again():
        node = await store.get_node(NODE)
        w = await workloads(store)
        return node.gpus[0].healthy and set(w) == {bystander}

    await eventually(healthy_again)
    # the victims' placements are never restarted by the agent on its own
    assert (await workloads(store))[bystander].pid == before[bystander].pid


async def test_outcomes_are_classified_and_never_rerun(agent):
    a, store = agent
    epoch = await registered(store)
    ok = await place(store, epoch, 0, 50.0, 1024, "ResNet-18", 16, total_steps=5)
    bad = await place(store, epoch, 1, 50.0, 1024, "ResNet-18", 16,
                      command=f"{WORKLOAD_PY} -c 'import sys; print(\"boom\"); sys.exit(3)'")
    oom = await place(store, epoch, 1, 40.0, 1024, "ResNet-18", 16,
                      command=f"{WORKLOAD_PY} -c 'import sys; print(\"RuntimeError: CUDA out of memory\"); sys.exit(1)'")
    unparsable = await place(store, epoch, 1, 10.0, 1024, "ResNet-18", 16, command="python -c 'unterminated")

    async def ended():
        w = await workloads(store)
        return w if len(w) == 4 and all(x.status in ("succeeded", "failed") for x in w.values()) else None

    w = await eventually(ended)
    assert (w[ok].status, w[ok].reason, w[ok].exit_code) == ("succeeded", StateReason.COMPLETED, 0)
    assert w[ok].progress_steps == pytest.approx(5)
    assert (w[bad].status, w[bad].reason, w[bad].exit_code, w[bad].message) == ("failed", StateReason.OWN_FAILURE, 3, "exit 3")
    assert "boom" in Path(w[bad].log_path).read_text()
    assert w[oom].reason is StateReason.OWN_FAILURE and w[oom].message.startswith("out of memory")
    assert w[unparsable].reason is StateReason.OWN_FAILURE and w[unparsable].message.startswith("cannot start")
    await asyncio.sleep(1.0)  # still desired, but a placement that ran is never started again
    assert {j: x.started_at_s for j, x in (await workloads(store)).items()} == {j: x.started_at_s for j, x in w.items()}
    assert find_tagged(str(a.state_dir.resolve())) == {}


@pytest.mark.parametrize("workload_env", [{**synthetic_workload_env(), "ELASTICO_STOP_WORKLOADS_ON_EXIT": "1"}])
async def test_workloads_stopped_at_a_graceful_exit_are_reported_and_never_rerun_by_the_next_agent(agent):
    """ELASTICO_STOP_WORKLOADS_ON_EXIT (make up's agents): a SIGTERMed agent stops its workloads. They used to leave
    the ledger, so the restarted agent ran the same placement again from step 0 and the allocator never knew. Now
    each is reported killed (PREEMPTED) with its progress -- the allocator requeues it from there -- and the next
    agent does not start that placement again."""
    a, store = agent
    epoch = await registered(store)
    job = await place(store, epoch, 0, 50.0, 1024, "ResNet-18", 16)

    async def progressing():
        w = (await workloads(store)).get(job)
        return w if w is not None and w.status == "running" and w.progress_steps > 0 else None

    before = await eventually(progressing)
    assert a.proc is not None
    a.proc.send_signal(signal.SIGTERM)  # the agent alone (its workloads have process groups of their own)
    a.proc.wait(15)
    assert find_tagged(str(a.state_dir.resolve())) == {}  # its workloads are stopped
    w = (await workloads(store))[job]
    assert (w.status, w.reason) == ("killed", StateReason.PREEMPTED) and w.progress_steps >= before.progress_steps, \
        (w, a.log_path.read_text()[-3000:])
    a.start()  # the same desired state: the placement is still there
    await eventually(_node_known_again(store, a))
    await asyncio.sleep(1.0)  # several reconcile passes (0.2 s)
    again = (await workloads(store))[job]
    assert (again.status, again.started_at_s) == ("killed", w.started_at_s)
    assert find_tagged(str(a.state_dir.resolve())) == {}  # nothing started again


def _node_known_again(store: RedisStore, a: AgentProc):
    started = time.time()

    async def fresh():
        node = await store.get_node(NODE)
        return node.last_heartbeat_s >= started
    return fresh


@pytest.mark.parametrize("workload_env", [{**synthetic_workload_env(), "ELASTICO_FENCE_S": "2"}])
async def test_a_workload_whose_agent_is_silent_past_the_fence_is_stopped_by_its_supervisor(agent):
    """An agent stopped (SIGSTOP) longer than ELASTICO_FENCE_S: each workload's shim stops its workload before
    the allocator would place the job elsewhere; the agent, back, reports it killed for NODE_LOST."""
    a, store = agent
    epoch = await registered(store)
    job = await place(store, epoch, 0, 50.0, 1024, "ResNet-18", 16)

    async def running():
        w = (await workloads(store)).get(job)
        return w if w is not None and w.status == "running" else None

    child = child_of((await eventually(running)).pid)
    await asyncio.sleep(3.0)  # longer than the fence while the agent lives: nothing is stopped
    assert Path(f"/proc/{child}").exists() and (await workloads(store))[job].status == "running"
    assert a.proc is not None
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not Path(f"/proc/{child}").exists(), "the workload kept running under a silent agent"
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)

    async def ended():
        w = (await workloads(store)).get(job)
        return w if w is not None and w.status == "killed" else None

    w = await eventually(ended)
    assert w.reason is StateReason.NODE_LOST and "no sign of life" in w.message
    assert "stopping the workload (fence)" in Path(w.log_path).read_text()


def test_nvml_backend_on_a_driverless_machine_is_a_clear_error(redis_server):
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("an NVIDIA driver is present")
    except pynvml.NVMLError:
        pass
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICO_")}
    with reachable_dir() as state_dir:
        env.update({"ELASTICO_INSECURE": "1", "ELASTICO_REDIS_URL": redis_server.url, "ELASTICO_PORT": "0",
                    "ELASTICO_STATE_DIR": str(state_dir)})
        res = subprocess.run([sys.executable, "-m", "services.node_agent", "--gpu-backend", "nvml"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert res.returncode == 3, res.stderr
    assert "NVML unavailable" in res.stderr and "ELASTICO_GPU_BACKEND=simulated" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_shims_child_between_fork_and_exec_is_not_taken_for_the_shim(tmp_path):
    """Until it execs, a shim's forked child shows the shim's command line and tag; the scan keeps the shim."""
    code = "import os, sys, time; os.fork() or print(os.getpid(), flush=True); time.sleep(60)"
    tag = f"{tmp_path}|job-1|1:2.5"
    shim = subprocess.Popen([sys.executable, "-c", code, "services.node_agent.shim"], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "ELASTICO_WORKLOAD_TAG": tag}, start_new_session=True)
    try:
        child = int(shim.stdout.readline())
        assert child != shim.pid and read_environ(child).get("ELASTICO_WORKLOAD_TAG") == tag
        assert find_tagged(str(tmp_path)) == {("job-1", "1:2.5"): shim.pid}
    finally:
        os.killpg(shim.pid, signal.SIGKILL)
        shim.wait()
