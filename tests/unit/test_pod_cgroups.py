"""The node agent's pure pod parsing (services/node_agent/pods.py): which pod a process's cgroup names, what a pod's
status means for its job's report, and the /proc scan built on it (services/node_agent/podwatch.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastico.domain import GpuCounters, StateReason
from services.node_agent.pods import (
    PodProcess,
    ending,
    main_process,
    parse_stat,
    pod_outcome,
    pod_uid_from_cgroup,
    sum_counters,
)
from services.node_agent.podwatch import scan_pod_processes

UID = "6b9f1c2e-3d4a-4b5c-8d7e-0f1a2b3c4d5e"
UID_ = UID.replace("-", "_")
CID = "0f3c2a1b" * 8


@pytest.mark.parametrize("text", [
    # cgroup v2, cgroupfs driver: burstable, besteffort, guaranteed (no QoS level)
    f"0::/kubepods/burstable/pod{UID}/{CID}\n",
    f"0::/kubepods/besteffort/pod{UID}/{CID}\n",
    f"0::/kubepods/pod{UID}/{CID}\n",
    # cgroup v2, systemd driver (containerd and CRI-O scopes), guaranteed
    f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
    f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/crio-{CID}.scope\n",
    f"0::/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
    # relative to the reader's cgroup namespace (the agent's own container)
    f"0::/../../pod{UID}/{CID}\n",
    f"0::/../../kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope\n",
    # cgroup v1: one line per hierarchy, cgroupfs and systemd
    f"12:pids:/kubepods/burstable/pod{UID}/{CID}\n11:memory:/kubepods/burstable/pod{UID}/{CID}\n1:name=systemd:/kubepods/burstable/pod{UID}/{CID}\n",
    f"11:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/docker-{CID}.scope\n0::/\n",
    # the pod cgroup itself (a process in the pod but in no container's group)
    f"0::/kubepods/burstable/pod{UID}\n",
])
def test_pod_uid_from_every_cgroup_layout(text: str) -> None:
    assert pod_uid_from_cgroup(text) == UID


@pytest.mark.parametrize("text", [
    "0::/user.slice/user-0.slice/session-3.scope\n",
    "0::/system.slice/containerd.service\n",
    "12:pids:/docker/abcdef\n0::/\n",
    "0::/kubepods/burstable\n",  # a QoS parent, no pod
    f"0::/srv/mypod{UID}/x\n",  # "pod<uid>" must be a whole segment
    f"0::/kubepods/burstable/pod{UID[:-1]}/{CID}\n",  # not a UID
    "garbage without colons\n",
    "",
])
def test_non_pod_cgroups_name_no_pod(text: str) -> None:
    assert pod_uid_from_cgroup(text) is None


def test_parse_stat_handles_odd_comms_and_zombies() -> None:
    rest = " ".join(["S", "41", *["0"] * 17, "987654"])  # state, ppid, ... field 22 = start ticks
    st = parse_stat(f"123 (python3 (x) y) {rest} 0 0")
    assert st is not None and (st.comm, st.state, st.ppid, st.start_ticks, st.alive) == ("python3 (x) y", "S", 41, 987654, True)
    zombie = parse_stat(f"123 (sleep) Z 41 {' '.join(['0'] * 17)} 5")
    assert zombie is not None and not zombie.alive
    assert parse_stat("123 (short) S 1 2") is None
    assert parse_stat("no parentheses at all") is None


def test_main_process_is_the_oldest_container_root() -> None:
    procs = [PodProcess(200, 10, 500), PodProcess(201, 200, 400), PodProcess(300, 11, 600)]  # 201 is 200's child
    assert main_process(procs) == PodProcess(200, 10, 500)
    assert main_process([]) is None


def test_counters_are_summed_over_the_pods_processes() -> None:
    total = sum_counters([GpuCounters(sm_util_pct=30.0, mem_used_mib=1000.0), GpuCounters(sm_util_pct=12.5, mem_used_mib=24.0),
                          GpuCounters()])
    assert total == GpuCounters(sm_util_pct=42.5, mem_used_mib=1024.0)  # bandwidth/tensor unknown everywhere: unknown
    assert sum_counters([]) == GpuCounters()


# --- outcomes -------------------------------------------------------------------------------------------------
def pod(phase: str, *statuses: dict, deleting: bool = False, conditions: tuple = (), **status) -> dict:
    meta = {"name": "p", "namespace": "ns", "uid": UID, **({"deletionTimestamp": "2030-01-01T00:00:00Z"} if deleting else {})}
    return {"metadata": meta, "status": {"phase": phase, "containerStatuses": list(statuses), "conditions": list(conditions),
                                         **status}}


def terminated(name: str, code: int, reason: str = "Error", **kw) -> dict:
    return {"name": name, "restartCount": 0, "state": {"terminated": {"exitCode": code, "reason": reason, **kw}}}


def running(name: str, restarts: int = 0) -> dict:
    return {"name": name, "restartCount": restarts, "state": {"running": {"startedAt": "2030-01-01T00:00:00Z"}}}


def test_succeeded_once_its_processes_are_gone() -> None:
    p = pod("Succeeded", terminated("main", 0, "Completed"))
    assert pod_outcome(p, has_processes=True, seen=True).status == "running"  # the end waits for the containers
    out = pod_outcome(p, has_processes=False, seen=True)
    assert (out.status, out.reason, out.exit_code, out.ended) == ("succeeded", StateReason.COMPLETED, 0, True)


def test_failed_with_its_exit_code() -> None:
    out = pod_outcome(pod("Failed", terminated("side", 0, "Completed"), terminated("main", 3)), False, True)
    assert (out.status, out.reason, out.exit_code) == ("failed", StateReason.OWN_FAILURE, 3)
    assert "container main" in out.message and "exit 3" in out.message


def test_oom_killed_container_is_named_in_the_message() -> None:
    out = pod_outcome(pod("Failed", terminated("a", 1), terminated("b", 137, "OOMKilled")), False, True)
    assert (out.status, out.reason, out.exit_code) == ("failed", StateReason.OWN_FAILURE, 137)
    assert "OOMKilled" in out.message and "container b" in out.message


def test_failed_without_container_statuses_keeps_the_pods_reason() -> None:
    out = pod_outcome(pod("Failed", reason="DeadlineExceeded", message="active deadline reached"), False, True)
    assert (out.status, out.exit_code) == ("failed", None) and "DeadlineExceeded" in out.message


def test_evicted_or_deleted_pods_are_preempted_only_after_their_processes_exit() -> None:
    evicted = pod("Running", running("main"), deleting=True,
                  conditions=({"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"},))
    assert pod_outcome(evicted, True, True).status == "running"
    out = pod_outcome(evicted, False, True)
    assert (out.status, out.reason) == ("killed", StateReason.PREEMPTED) and "EvictionByEvictionAPI" in out.message
    # containers killed by SIGTERM make the pod Failed: still an eviction, not the job's own failure
    failed_evicted = pod("Failed", terminated("main", 143), deleting=True,
                         conditions=({"type": "DisruptionTarget", "status": "True"},))
    assert pod_outcome(failed_evicted, False, True).reason is StateReason.PREEMPTED
    assert pod_outcome(pod("Failed", terminated("main", 137), reason="Evicted", message="node low on memory"),
                       False, True).reason is StateReason.PREEMPTED  # kubelet's node-pressure eviction
    deleted = pod_outcome(pod("Running", running("main"), deleting=True), False, True)
    assert (deleted.status, deleted.reason, deleted.message) == ("killed", StateReason.PREEMPTED, "pod deleted")
    gone = pod_outcome(None, False, True)
    assert (gone.status, gone.reason) == ("killed", StateReason.PREEMPTED)
    assert pod_outcome(None, True, True).status == "running"  # object gone, containers not yet
    # the object went right after its containers: the end says why it was going, as last seen
    assert ending(evicted) == out.message and ending(pod("Running", deleting=True)) == "pod deleted" and ending(pod("Running")) == ""
    assert pod_outcome(None, False, True, last_ending=ending(evicted)).message == out.message


def test_a_pod_not_seen_yet_or_pending_is_starting() -> None:
    assert pod_outcome(None, False, seen=False).status == "starting"
    pending = pod("Pending", {"name": "main", "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}})
    out = pod_outcome(pending, False, True)
    assert (out.status, out.ended) == ("starting", False) and "ContainerCreating" in out.message
    assert pod_outcome(pod("Pending"), True, True).status == "starting"  # init containers run


def test_running_pod_with_restarting_containers_is_not_an_end() -> None:
    crashing = pod("Running", {"name": "main", "restartCount": 4, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                               "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}}, running("side"))
    between = pod_outcome(crashing, False, True)
    assert (between.status, between.ended) == ("starting", False)
    assert "CrashLoopBackOff" in between.message and "4 restarts" in between.message and "last exit 1" in between.message
    up = pod_outcome(crashing, True, True)
    assert (up.status, up.ended) == ("running", False) and "CrashLoopBackOff" in up.message
    assert pod_outcome(pod("Running", running("main", restarts=2)), True, True).message == ""  # restarted, runs again


# --- the /proc scan ---------------------------------------------------------------------------------------------
def fake_proc(root: Path, pid: int, cgroup: str, comm: str = "python3", state: str = "S", ppid: int = 1, ticks: int = 100) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "cgroup").write_text(cgroup)
    (d / "stat").write_text(f"{pid} ({comm}) {state} {ppid} {' '.join(['0'] * 17)} {ticks} 0 0\n")


def test_scan_finds_each_pods_live_container_processes(tmp_path: Path) -> None:
    other = "0f1e2d3c-4b5a-4968-8776-655443322110"
    fake_proc(tmp_path, 10, f"0::/kubepods/burstable/pod{UID}/{CID}\n", ticks=50)
    fake_proc(tmp_path, 11, f"0::/kubepods/burstable/pod{UID}/{CID}\n", ppid=10, ticks=60)
    fake_proc(tmp_path, 12, f"0::/kubepods/burstable/pod{UID}/{'1' * 64}\n", comm="pause")  # the sandbox: not a container
    fake_proc(tmp_path, 13, f"0::/kubepods/burstable/pod{UID}/{CID}\n", state="Z")  # exited, not reaped
    fake_proc(tmp_path, 20, f"0::/kubepods.slice/kubepods-pod{other.replace('-', '_')}.slice/cri-containerd-{CID}.scope\n")
    fake_proc(tmp_path, 30, "0::/system.slice/sshd.service\n")
    (tmp_path / "31").mkdir()  # vanished between listing and reading
    (tmp_path / "self").mkdir()
    found = scan_pod_processes(tmp_path)
    assert {u: sorted(p.pid for p in ps) for u, ps in found.items()} == {UID: [10, 11], other: [20]}
    assert main_process(found[UID]).pid == 10
    assert scan_pod_processes(tmp_path / "missing") == {}
