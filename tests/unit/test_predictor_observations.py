"""The predictor's observation rules, its refreshed-model path, and what it serves at start-up."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from elastico.errors import ConfigError
from elastico.limits import text_problem
from services.node_agent import observations as agent_obs
from services.predictor import datasets as D
from services.predictor import observation_rules as rules
from services.predictor.features import JobProfile, Observation
from services.predictor.model import InterferenceModel, artifact, train_model
from services.predictor.servicer import load_or_train
from services.predictor.settings import PredictorSettings

NOW = 1_800_000_000.0


@pytest.mark.parametrize("v", [1e-6, 0.3, 1.0, rules.NORM_TPUT_MAX])
def test_honest_normalised_throughputs_are_accepted(v):
    assert rules.norm_problem(v) is None


@pytest.mark.parametrize("v", [0.0, -0.1, 1.5, 4.56, math.nan, math.inf, 1e300])
def test_normalised_throughputs_outside_the_range_are_refused(v):
    assert rules.norm_problem(v) == f"must be in (0, 1.2], got {v!r}"


def test_the_node_agent_reports_only_what_the_predictor_accepts():
    assert agent_obs.NORM_TPUT_MAX == rules.NORM_TPUT_MAX  # one bound for both (elastico.limits)


@pytest.mark.parametrize("t", [math.nan, math.inf, 1e300, NOW + 301, NOW - 3601, -1.0])
def test_measurement_times_outside_the_window_are_refused(t):
    assert rules.time_problem(t, NOW, 3600, 300) is not None


@pytest.mark.parametrize("t", [NOW, NOW + 299, NOW - 3599])
def test_measurement_times_within_the_window_are_accepted(t):
    assert rules.time_problem(t, NOW, 3600, 300) is None


@pytest.mark.parametrize("text", ["\x1b[31mEvil\x00", "a\nb", "tab\there", "\u2028"])
def test_control_characters_are_refused(text):
    assert text_problem(text, 128) == "must not contain control or other non-printable characters"


def test_printable_text_is_accepted_and_long_text_refused():
    assert text_problem("ResNet-50 (Ü)", 128) is None
    assert text_problem("x" * 129, 128) == "must be at most 128 characters, got 129"


def _obs(family: str = "ResNet-50", gpu: str = "v100", a: float = 0.7, b: float = 0.8) -> Observation:
    return Observation(JobProfile(family, gpu, 32), JobProfile("ResNet-18", gpu, 32), a, b, source="observation")


def test_only_known_families_gpu_types_and_in_range_values_are_learnable():
    families = {"resnet50", "resnet18"}
    assert rules.learnable(_obs(), families)
    assert not rules.learnable(_obs("\x1b[31mEvil\x00"), families)  # canonicalised to "31mevil": unknown
    assert not rules.learnable(_obs(gpu="b300"), families)
    assert not rules.learnable(_obs(a=1.5), families)  # logged before the checks: kept out of training
    assert not rules.learnable(_obs(b=0.0), families)


# --- settings: where the refreshed model goes ------------------------------------------------------------

INSECURE = {"ELASTICO_INSECURE": "1"}


def test_refreshed_model_goes_under_the_local_clusters_run_dir(tmp_path):
    s = PredictorSettings.from_env({**INSECURE, "ELASTICO_RUN_DIR": str(tmp_path / "run")})
    assert s.effective_refreshed_model_path == tmp_path / "run" / "predictor" / "interference.json"
    assert Path(s.model_path).resolve() != s.effective_refreshed_model_path


def test_refreshed_model_goes_under_xdg_state_home_without_a_run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    s = PredictorSettings.from_env(INSECURE)
    assert s.effective_refreshed_model_path == tmp_path / "xdg" / "elastico" / "predictor" / "interference.json"


def test_state_dir_and_refreshed_model_path_override_the_default(tmp_path):
    env = {**INSECURE, "ELASTICO_RUN_DIR": str(tmp_path / "run"), "ELASTICO_STATE_DIR": str(tmp_path / "st")}
    assert PredictorSettings.from_env(env).effective_refreshed_model_path == tmp_path / "st" / "interference.json"
    env["ELASTICO_REFRESHED_MODEL_PATH"] = str(tmp_path / "r.json")
    assert PredictorSettings.from_env(env).effective_refreshed_model_path == tmp_path / "r.json"


@pytest.mark.parametrize(("var", "value"), [("ELASTICO_OBSERVATION_MAX_AGE_S", "nan"), ("ELASTICO_OBSERVATION_MAX_AGE_S", "0"),
                                            ("ELASTICO_OBSERVATION_MAX_FUTURE_S", "-1")])
def test_bad_observation_windows_refuse_to_start(var, value):
    with pytest.raises(ConfigError, match=var):
        PredictorSettings.from_env({**INSECURE, var: value})


def test_refreshed_model_path_equal_to_the_shipped_one_refuses_to_start(tmp_path):
    env = {**INSECURE, "ELASTICO_MODEL_PATH": str(tmp_path / "m.json"), "ELASTICO_REFRESHED_MODEL_PATH": str(tmp_path / "m.json")}
    with pytest.raises(ConfigError, match="ELASTICO_REFRESHED_MODEL_PATH"):
        PredictorSettings.from_env(env)


# --- start-up: refreshed model if usable, else the shipped one ---------------------------------------------

@pytest.fixture(scope="module")
def small_model() -> InterferenceModel:
    catalog = D.ProfileCatalog.from_gavel(D.PROJECT_DATA_DIR)
    return train_model(D.read_pair_file(D.PROJECT_DATA_DIR / "coloc_gavel_pairs.csv", catalog)[:200], seed=0, catalog=catalog)


def _write(model: InterferenceModel, path: Path, version: str, created: float) -> bytes:
    d = model.to_json_dict()
    d.update(version=version, created_at_unix_s=created)
    artifact.write_atomic(path, d)
    return path.read_bytes()


@pytest.fixture
def paths(tmp_path) -> tuple[PredictorSettings, Path, Path]:
    s = PredictorSettings.from_env(INSECURE, model_path=str(tmp_path / "shipped.json"), state_dir=str(tmp_path / "state"))
    return s, Path(s.model_path), s.effective_refreshed_model_path


def test_a_newer_refreshed_model_is_served(paths, small_model):
    s, shipped, refreshed = paths
    before = _write(small_model, shipped, "shipped", 100.0)
    _write(small_model, refreshed, "refreshed", 200.0)
    assert load_or_train(s).version == "refreshed"
    assert shipped.read_bytes() == before


def test_the_shipped_model_is_served_without_a_usable_or_recent_refreshed_one(paths, small_model):
    s, shipped, refreshed = paths
    _write(small_model, shipped, "shipped", 100.0)
    assert load_or_train(s).version == "shipped"  # none
    refreshed.parent.mkdir(parents=True)
    refreshed.write_text('{"format": "elastico-interference-model/3", "junk": true}')
    assert load_or_train(s).version == "shipped"  # unusable
    _write(small_model, refreshed, "refreshed", 50.0)
    assert load_or_train(s).version == "shipped"  # older than the shipped one (an upgrade)


def test_artifacts_are_written_for_the_owner_only(tmp_path, small_model):
    path = small_model.save(tmp_path / "m.json")
    assert os.stat(path).st_mode & 0o777 == 0o600
