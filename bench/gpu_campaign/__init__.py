"""GPU campaign: real models co-located under MPS shares -- training next to training and next to inference.

Issue 25. Every co-location figure the simulator and the predictor use is training next to training on other
people's GPUs; this measures, on the GPU the project is lent, real models in plain PyTorch (random weights,
synthetic data, nothing downloaded): ResNet-50 and a GPT-2-small LM training (bf16 autocast and fp32), a BERT-base
encoder, a GPT-2-small decoder (KV cache) and a small-batch ResNet-18 serving open-loop Poisson requests with a
measured latency distribution. It reuses the device check's machinery (``bench.device_check``: child processes, one
common window, the node agent's own ``NvmlBackend`` and ``RealMps``). Stages, in order, each recording its error
while the run goes on (``workloads.build_plan`` lists the points):

1. ``environment``, ``nvml``, ``mps`` -- versions, NVML inventory, one MPS control daemon for the whole run.
2. ``solo`` -- every workload alone at MPS 100: the baselines; each service fixes its offered rate (0.4 of its
   largest-batch capacity) and its SLO (p99 <= 4x its largest batch's time) for every later point.
3. ``pairs`` -- training+inference and training+training at 100/100 and 50/50: each tenant normalised to its solo
   rate (a service's rate is the highest rate it serves within its SLO, searched after the window), p50/p99 at the
   offered rate.
4. ``isolation`` -- a client over its pinned memory limit fails alone; a deliberate fatal fault in one client and
   what its co-tenant, MPS health and ``fault_events`` (the agent's COTENANT_FAULT path) see; a recovery client.
5. ``priority`` -- training at ``CUDA_MPS_CLIENT_PRIORITY=1`` next to a service at 0, if the driver offers it.
6. ``shares`` -- every workload alone at MPS 50/25/10/75, and the fit of ``speed = min(1, share/u)`` per job.
7. ``splits`` -- training+inference at 70/30 and 30/70.

Every point carries NVML/GPM counters sampled inside its window. The plan, with each point's estimated time, is
printed first; ``--budget-s`` (default 480) is checked before every stage and point, and what does not fit is
skipped (the head of the list is what matters most). Run on the GPU machine, from the project root (no virtualenv
there: ``make device-deps`` here unpacks structlog into ``.device-deps/site``; carry that folder)::

    PYTHONPATH=.device-deps/site python3 -m bench.gpu_campaign --out $OUT     # <= 8 min; --quick: ~3 min smoke
    python3 -m bench.gpu_campaign.derive $OUT/gpu_campaign.json --out $OUT/derived   # tables + provenance

It writes ``$OUT/gpu_campaign.json`` after every point (a killed run leaves its partial results). ``--dry-run`` runs
the whole orchestration without a GPU (fake workers sleeping for the GPU work, a stand-in pynvml, ``SimulatedMps``).

Exit status: 0 every stage ok; 1 a stage failed or was cut by the budget (see the JSON); 2 no GPU (without
``--dry-run``), a missing module or bad arguments; 143 terminated. Modules of this package import only the
standard library at module level: torch, pynvml and the project's code are imported where they are used.
"""
