"""Versioned cluster state behind one interface (``Store``), with Redis and in-memory backends."""

from elastico.state.store import Store, StoreBase
from elastico.state.transaction import Transaction

__all__ = ["Store", "StoreBase", "Transaction"]
