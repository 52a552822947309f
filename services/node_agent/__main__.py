"""``python -m services.node_agent [--gpu-backend nvml|simulated|auto]``: one agent per node.

Start-up order matters: re-adopt the ledger's workloads and start MPS *before* serving or polling, so
the first reconcile pass already knows what runs (no duplicate starts after a restart); register the
node (first heartbeat) so the allocator sees its GPUs at once; then serve Sync and poll. In Kubernetes mode
(``ELASTICO_KUBE_PODS``) the re-adoption also starts the watch of the pods bound to this node.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from elastico.errors import ConfigError
from elastico.logging import get_logger
from elastico.rpc.security import Access, ClientTLS, PeerPolicy, certificate_name, roles
from elastico.rpc.server import ServiceBinding, run_main
from elastico.state.redis_store import RedisStore
from elastico.tasks import cancel_until_done
from elastico.v1 import node_agent_pb2, node_agent_pb2_grpc
from services.node_agent.gpu import make_backend
from services.node_agent.liveness import StoreFence
from services.node_agent.mps import make_mps
from services.node_agent.observations import PredictorReporter
from services.node_agent.pods import PodSource
from services.node_agent.reconcile import Reconciler
from services.node_agent.runner import REPO_ROOT
from services.node_agent.servicer import NodeAgent, NodeAgentServicer
from services.node_agent.settings import NodeAgentSettings, WorkloadPolicy

log = get_logger(component="node_agent")


def log_workload_policy(p: WorkloadPolicy) -> None:
    """Say at start who workloads run as; loudly when it is root or when they cannot reach the synthetic workload."""
    log.info("workloads run as", uid=p.uid, gid=p.gid, user=p.user, commands_allowed=p.allow_commands,
             rlimits=dict(p.rlimits))
    if p.uid == 0:
        log.warning("WORKLOADS RUN AS ROOT (ELASTICO_ALLOW_ROOT_WORKLOADS=1): every job command has full control of "
                    "this node; set ELASTICO_WORKLOAD_USER to an unprivileged user")
    if p.drops_privileges and not p.synthetic_drops:
        log.warning("the workload user cannot run a Python interpreter or read this checkout: synthetic workloads "
                    "(jobs without a command: the agent's own code) run as the agent's user; job commands still run "
                    "as the workload user", uid=p.uid, checkout=str(REPO_ROOT))


def build(settings: NodeAgentSettings):
    async def _build():
        node_id = settings.effective_node_id
        log_workload_policy(settings.workload_policy)
        tls = ClientTLS.from_settings(settings)
        if tls.files is not None and certificate_name(tls.files.cert_file) != f"node/{node_id}":
            raise ConfigError(f"ELASTICO_TLS_CERT_FILE names {certificate_name(tls.files.cert_file)!r}; the agent of node "
                              f"{node_id!r} needs a certificate for 'node/{node_id}' (its identity to its peers)")
        backend = make_backend(settings.gpu_backend, node_id, settings.sim_gpu_type, settings.sim_gpu_count, settings.sim_gpu_mem_mib,
                               settings.sim_time_scale)
        try:
            policy = settings.workload_policy
            mps = make_mps(settings.mps, backend.name, settings.effective_mps_pipe_dir, settings.effective_mps_log_dir,
                           settings.mps_control_bin, settings.mps_control_timeout_s,
                           run_as=(policy.uid, policy.gid) if policy.drops_privileges else None)
        except BaseException:
            backend.close()
            raise
        store = RedisStore.from_url(settings.redis_url, namespace=settings.redis_namespace)
        await store.ping()
        address = settings.advertise_address or f"{settings.host}:{settings.port}"
        gpu_type = next((g.gpu_type for g in backend.gpus()), "")
        reporter = PredictorReporter(settings.predictor_address, gpu_type, settings.predictor_timeout_s, tls) if settings.predictor_address else None
        pods: PodSource | None = None
        if settings.kube_pods:
            from services.node_agent.podwatch import KubePods, PodWatcher, core_api  # the kubernetes client only here

            pods = KubePods(PodWatcher(core_api(settings.kube_api_url), node_id, request_timeout_s=settings.kube_timeout_s),
                            Path(settings.proc_root))
            log.info("following the pods bound to this node (Kubernetes mode)", node=node_id, proc_root=settings.proc_root,
                     api=settings.kube_api_url or "in-cluster")
        reconciler = Reconciler(store, backend, mps, node_id, settings.effective_state_dir,
                                stop_grace_s=settings.stop_grace_s, fault_holddown_s=settings.mps_fault_holddown_s,
                                observation_interval_s=settings.observation_interval_s, observation_sink=reporter,
                                policy=settings.workload_policy, scrape_interval_s=settings.scrape_interval_s, pods=pods,
                                fence_s=settings.fence_s)
        await reconciler.recover()
        fence = StoreFence(settings.allocator_address_list, tls, silence_s=settings.heartbeat_interval_s + 1.0)
        agent = NodeAgent(store, backend, node_id, address, reconciler, fence)
        await agent.heartbeat()  # register before serving, so the allocator sees the GPUs at once
        tasks = [asyncio.create_task(agent.heartbeat_forever(settings.heartbeat_interval_s)),
                 asyncio.create_task(reconciler.run_forever(settings.reconcile_interval_s))]
        if settings.fence_s > 0:
            if not fence.allocators:
                log.warning("no ELASTICO_ALLOCATOR_ADDRESSES: this agent cannot tell a store outage from being cut off "
                            "from the store, so an outage longer than ELASTICO_FENCE_S stops its workloads",
                            fence_s=settings.fence_s)
            tasks.append(asyncio.create_task(fence.keep_alive(reconciler.runner)))

        async def cleanup() -> None:
            async with reconciler.between_passes():  # the loops stop between two passes, not in the middle of one
                await cancel_until_done(tasks)
            if settings.stop_workloads_on_exit:
                await reconciler.stop_all()
            await reconciler.aclose()
            if reporter is not None:
                await reporter.close()
            backend.close()
            await store.close()

        binding = ServiceBinding(node_agent_pb2.DESCRIPTOR.services_by_name["NodeAgent"].full_name,
                                 NodeAgentServicer(agent), node_agent_pb2_grpc.add_NodeAgentServicer_to_server,
                                 Access(PeerPolicy(roles("allocator", "operator"))))
        return [binding], cleanup

    return _build


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m services.node_agent", description="ElastiCo node agent (settings: ELASTICO_* variables)")
    ap.add_argument("--gpu-backend", choices=("nvml", "simulated", "auto"), help="overrides ELASTICO_GPU_BACKEND")
    args = ap.parse_args(argv)
    overrides = {"gpu_backend": args.gpu_backend} if args.gpu_backend else {}
    return run_main(lambda: NodeAgentSettings.from_env(**overrides), build)


if __name__ == "__main__":
    sys.exit(main())
