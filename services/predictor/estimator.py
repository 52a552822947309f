"""The predictor as a policy's interference estimator (``InterferenceEstimator.pair_matrix``).

Front ends (the simulator's ``--estimator predictor``, the allocator's decider) build it and inject it into
the policy; the pure policy never imports the predictor.
"""

from __future__ import annotations

import numpy as np

from elastico.coloc.profiles import TypeTable
from services.predictor import model as pm
from services.predictor.datasets import ProfileCatalog


class PredictorEstimator:
    """Adapter over the interference predictor core (``services.predictor.model.InterferenceModel``).

    The predictor is queried once for every ordered pair of training types on the table's GPU type;
    inference rows stay NaN (utilisation rule) because the predictor's training data holds no inference
    pairs. Kept in this one adapter so a change of the predictor's API touches one place.
    """

    def __init__(self, model) -> None:  # model: services.predictor.model.InterferenceModel
        self.model = model

    @classmethod
    def from_artifact(cls, path=None) -> PredictorEstimator:
        """Load the trained artifact (``python -m services.predictor.train`` builds it).

        Raises:
            FileNotFoundError / ValueError: the artifact is missing or malformed.
        """
        return cls(pm.load_model(path) if path else pm.load_model())

    def pair_matrix(self, types: TypeTable) -> np.ndarray:
        cat = getattr(self.model, "catalog", None) or ProfileCatalog.default()
        train = [n for n in types.names if n != types.names[types.inference_index]]
        profs = [cat.gavel(n, types.gpu_type) for n in train]
        idx = [(i, j) for i in range(len(train)) for j in range(i, len(train))]
        pred = np.asarray(self.model.predict_pairs([(profs[i], profs[j]) for i, j in idx]), float)
        T = len(types.names)
        m = np.full((T, T), np.nan)
        for (i, j), (pi, pj) in zip(idx, pred):
            m[i, j] = pi
            m[j, i] = pj
        return np.clip(m, 0.0, 1.0)
