"""The interference model: how much of its isolated throughput each job keeps when sharing a GPU.

``InterferenceModel`` predicts, for an ordered pair (A, B) on one GPU type, A's normalised throughput
(co-located / isolated). It is an ensemble of learners that see the same training pairs:

* **XGBoost** (pseudo-Huber loss, two bagged boosters with different seeds) on the feature schema of
  :mod:`services.predictor.features` plus a learned pair encoding (:mod:`.encoders`); the boosters are
  constrained to rise with the encoding and start from a job-type additive prior (their base margin),
  fitting only the residual.
* **Biased matrix factorisation** per GPU type over job types (:mod:`.factors`), blended in (weight
  ``mf_weight``) where both job types were seen in the domain.
* **Cap classifiers**: MAE is minimised by the conditional *median*, and the two learners above fit
  something close to the mean; where a domain has a mass of values at exactly 1 (the job kept all its
  isolated throughput), a logistic XGBoost per domain estimates P(value = 1), and where it is at least 1/2
  the answer is 1.0, the median of such a value.

Symmetry: every learner models the *ordered* row (A next to B); training uses both orderings of every
measured pair and a pair is predicted as ``[f(A|B), f(B|A)]``, so ``predict(B, A)`` is exactly
``predict(A, B)`` with its two outputs swapped.

Outputs are clipped to [0, 1]: co-location cannot make a job faster than alone (Lucid's values above 1 are
measurement noise).

Confidence: a prediction is *low-confidence* when either model family, the GPU type or the measurement
environment was never seen in training; the model still answers (from task features, counters and
architecture class).

Environments: rows carry the environment they were measured in (``JobProfile.env``: "" = this cluster,
"gavel", "gavel-oracle", "lucid"). Measurements from different environments disagree and sharing one set
of trees cost accuracy, so encodings and factorisation are kept per (GPU type, environment) "domain", every
environment with enough rows gets boosters of its own, and a *general* booster set trained on all rows
answers for environments with too few rows for their own (this cluster's first observations). A request
from an environment without any training rows (a live request before this cluster has reported
observations) is answered as the *reference* environment (this cluster once it has rows, else Gavel's
measured campaign): same GPU type, same job types, best available data.

MPS shares: ``mps_share_pct`` is a feature, but every shipped measurement ran without MPS limits (100%),
so the trained model cannot yet tell 30% from 100%; observations with limits fix that through retraining.

Modules: :mod:`.params` (hyper-parameters), :mod:`.encoders`, :mod:`.factors`, :mod:`.table` (request
profile ids), :mod:`.ensemble` (the model and prediction), :mod:`.artifact` (the saved format),
:mod:`.training`. The measurements behind the design are in docs/results.md ("Interference predictor: measurement history").

This package is pure (numpy + xgboost): no gRPC, Redis or protobuf.
"""

from services.predictor.model.artifact import ARTIFACT_FORMAT, DEFAULT_MODEL_PATH, ArtifactError
from services.predictor.model.ensemble import InterferenceModel, Prediction, load_model, save_model
from services.predictor.model.params import TrainParams
from services.predictor.model.training import data_digest, ordered_examples, train_model

__all__ = ["ARTIFACT_FORMAT", "DEFAULT_MODEL_PATH", "ArtifactError", "InterferenceModel", "Prediction", "TrainParams",
           "data_digest", "load_model", "ordered_examples", "save_model", "train_model"]
