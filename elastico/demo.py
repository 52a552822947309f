"""``make demo``: bring up the whole local suite, show what it reports, and tear it down.

Starts an embedded Redis, the pricer, predictor, allocator and N node agents on simulated GPUs (see
``elastico.cluster``), prints each service's health and the GPUs every node agent reports through its
gRPC API, submits one job through the allocator's API to show the round trip, then stops everything.
"""

from __future__ import annotations

import argparse
import sys
import uuid

import grpc

from elastico import cluster
from elastico.v1 import allocator_pb2, allocator_pb2_grpc, types_pb2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m elastico.demo")
    ap.add_argument("--nodes", type=int, default=2)
    args = ap.parse_args(argv)
    print("== starting the local ElastiCo suite (embedded Redis, 3 services, "
          f"{args.nodes} node agents on simulated GPUs)")
    try:
        state = cluster.up(args.nodes)
    except RuntimeError as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    try:
        print("\n== health and GPUs reported by the node agents")
        cluster.status()
        allocator = next(p["address"] for p in state["procs"] if p["name"] == "allocator")
        with grpc.insecure_channel(allocator) as ch:
            stub = allocator_pb2_grpc.AllocatorStub(ch)
            spec = types_pb2.JobSpec(name="demo-resnet", tenant="demo", kind=types_pb2.JOB_KIND_TRAINING,
                                     model_family="ResNet-50", batch_size=64,
                                     training=types_pb2.TrainingWork(total_steps=1000))
            rid = f"demo-{uuid.uuid4().hex[:8]}"
            job = stub.SubmitJob(allocator_pb2.SubmitJobRequest(request_id=rid, spec=spec), timeout=5).job
            again = stub.SubmitJob(allocator_pb2.SubmitJobRequest(request_id=rid, spec=spec), timeout=5)
            print(f"\n== allocator API: submitted {job.job_id} ({types_pb2.JobState.Name(job.state)}); "
                  f"retry with the same request_id returned the same job: {again.job.job_id == job.job_id}")
            cs = stub.GetClusterState(allocator_pb2.GetClusterStateRequest(), timeout=5)
            gpus = sum(len(n.gpus) for n in cs.nodes)
            print(f"== cluster state: {len(cs.nodes)} nodes, {gpus} GPUs, "
                  f"tenants: {', '.join(f'{t.tenant} ({t.pending_jobs} pending)' for t in cs.tenants)}")
    finally:
        print("\n== stopping")
        cluster.down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
