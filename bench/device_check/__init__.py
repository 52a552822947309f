"""Device check: real co-located throughput and MPS share limits on the GPU the project is lent.

The simulator's co-location figures come from other people's GPUs (Gavel's measured pairs, Lucid's rules) and it
assumes an MPS share caps a job's speed at ``min(1, share / solo utilisation)``. This check measures the same
quantities on a real GPU in one prepared run of a few minutes, with the node agent's own ``NvmlBackend`` and
``RealMps``, so the two can be set side by side. Stages, each recording its error while the run goes on:

1. ``environment`` -- ``nvidia-smi -q`` excerpt, package and torch/CUDA versions, the MPS binaries.
2. ``nvml`` -- ``NvmlBackend`` inventory and counters idle and under a ``mlp_bf16`` child (the orchestrator never
   creates a CUDA context of its own).
3. ``solo`` -- each workload alone, without MPS.
4. ``mps`` -- a control daemon started by ``RealMps``; each workload alone at active-thread shares 100/50/25,
   then in pairs at 100/100 and 50/50, normalised to solo at MPS 100. The daemon is always quit.
5. ``timeslice`` -- the pairs without MPS: required when MPS failed, else as far as the budget allows.

Run on the GPU machine, from the project root (no virtualenv there: ``make device-deps`` here unpacks the one
missing package, structlog, into ``.device-deps/site``; carry that folder)::

    PYTHONPATH=.device-deps/site python3 -m bench.device_check --out $OUT   # ~4 min; --quick: 2 s windows

It writes ``$OUT/device_check.json`` after every measurement (a killed run leaves its partial results) and
prints a summary; ``--budget-s`` (default 300) is checked before every stage and measurement. ``--dry-run`` runs
the whole orchestration without a GPU (fake workers, a stand-in pynvml object, ``SimulatedMps``).

Exit status: 0 every stage ok; 1 a stage failed or was skipped (see the JSON); 2 no GPU (without ``--dry-run``),
a missing module or bad arguments; 143 terminated. Modules of this package import only the standard library at
module level: torch, pynvml and the project's code are imported where they are used.
"""
