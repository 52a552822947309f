"""The pair matrix the rounds decide on: the calibrated rule's, or the predictor service's, refreshed every
``estimate_refresh_s`` and kept (with a degradation note) while the predictor is unavailable."""

from __future__ import annotations

import time

import numpy as np

from elastico.coloc.profiles import TypeTable
from elastico.errors import Unavailable
from elastico.logging import get_logger
from services.allocator.clients import PredictorClient
from services.allocator.estimate import rule_matrix

log = get_logger(component="rounds")


class PairEstimate:
    """``matrix``: the latest pair matrix (None = none yet); :meth:`current` refreshes it when due."""

    def __init__(self, estimator: str, predictor: PredictorClient | None, types: TypeTable, kappa: float,
                 refresh_s: float) -> None:
        self.rule, self.predictor, self.types, self.refresh_s = estimator == "rule", predictor, types, refresh_s
        self.matrix: np.ndarray | None = rule_matrix(types, kappa) if self.rule else None
        self._at = time.monotonic() if self.rule else 0.0  # when the matrix was obtained
        self._tried = 0.0  # when the predictor was last asked
        self._note = ""  # why the last ask failed ("" = it did not)

    async def current(self) -> tuple[np.ndarray | None, str]:
        """The pair matrix to use and a degradation note ("" = healthy)."""
        if self.rule:
            return self.matrix, ""
        now = time.monotonic()
        due = self.matrix is None or now - self._at >= self.refresh_s
        if due and self.predictor is not None and now - self._tried >= min(5.0, self.refresh_s):
            self._tried = now
            try:
                self.matrix = await self.predictor.pair_matrix(self.types)
                self._at = now
                self._note = ""
                log.info("interference estimate refreshed from the predictor", address=self.predictor.address)
            except Unavailable as exc:
                self._note = str(exc)
        if self.predictor is None:
            return None, "predictor not configured (ELASTICO_PREDICTOR_ADDRESS): no new co-location, whole GPUs only"
        if self.matrix is None:
            return None, f"predictor unavailable ({self._note}): no new co-location, whole GPUs only"
        if self._note:
            age = now - self._at
            return self.matrix, f"predictor unavailable ({self._note}): using its pair matrix from {age:.0f}s ago"
        return self.matrix, ""
