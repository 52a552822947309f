"""``python -m bench.reliability [--smoke] [--seed N] [--keep]``: the outside reliability probe of a live local cluster.

It starts a real cluster the way ``make up`` does (``devtools.cluster.up(2)``: embedded Redis with AOF and one ACL
user per process, pricer, predictor, allocator, two node agents with four simulated V100s each), secure as shipped
(mTLS, the operator's token, two tenant tokens), with the end-to-end tests' fast timers, in a fresh temporary run
directory, and probes it only through its public surfaces (gRPC, the processes, their /proc entries):

1. hostile input per service (10,000 requests; smoke 600): status-code histograms, UNKNOWN must be 0;
2. 1,000 (smoke 100) concurrent SubmitJob with duplicate request ids: none duplicated, none lost;
3. ``kill -9`` of a node agent, the allocator leader and Redis while the jobs run, under an invariant sampler
   (no GPU oversubscribed, no job running twice), then every job terminal or running;
4. RSS growth of every process (allocator <= 300 MB, others <= 200 MB);
5. GetClusterState p50/p99 with 10,000 (smoke 1,000) finished jobs in the store (target p50 <= 20 ms);
6. health of every server after everything.

Exit status 1 when correctness fails in either mode (UNKNOWN, lost, duplicated, oversubscribed, running twice);
speed and memory print PASS/FAIL in the full run only and never change it. ``--smoke`` ends well under 90 s on
2 cores; ``--keep`` keeps the run directory (service logs, Redis data).
"""
