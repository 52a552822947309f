"""Developer tooling on top of the suite: the local cluster supervisor (``make up``), the demo and the trace
replay. Nothing in ``elastico``, ``services`` or ``simulator`` imports it."""
