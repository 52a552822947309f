"""Versioned cluster state behind one interface (``Store``), with Redis and in-memory backends."""

from elastico.state.store import Store, StoreBase, Transaction

__all__ = ["Store", "StoreBase", "Transaction"]
