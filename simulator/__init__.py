"""Trace-driven discrete-event simulator of ElastiCo and its baselines.

It runs the *same* policy objects as the live allocator (``services.allocator.policy``) with a virtual
clock and an injected interference estimate; ground truth comes from measured data
(:mod:`elastico.coloc.truth`, shared with the node agent's simulated GPUs).

Modules: ``traces`` (trace -> job mapping), ``engine`` (events, speeds, capacity checks), ``metrics``,
``report`` (table, JSON, plots), ``run`` (one workload, many policies), ``__main__`` (CLI: ``python -m simulator --help``).
"""
