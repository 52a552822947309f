"""Typed policy options: one frozen, validated params dataclass per policy; make_policy rejects what a policy
does not accept; options_for hands each policy its part of a shared option set."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from elastico.errors import ConfigError
from services.allocator.policy import (
    POLICY_NAMES,
    ElastiCo,
    ElastiCoParams,
    LucidParams,
    MpsEqualShareParams,
    OptionError,
    PolicyParams,
    Tiresias,
    TiresiasParams,
    accepted_options,
    make_policy,
    options_for,
)
from services.allocator.settings import AllocatorSettings
from tests.unit._policy_builders import rule_matrix, view

M = rule_matrix()


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_an_unknown_option_is_an_error_naming_it(name):
    with pytest.raises(ValueError, match="no_such_option"):
        make_policy(name, M, 0.9, no_such_option=1)


@pytest.mark.parametrize("name, foreign", [
    ("elastico", "pack_floor"), ("exclusive-fifo", "train_floor"), ("exclusive-backfill", "slo_factor"),
    ("tiresias", "replicas"), ("mps-equal-share", "starve_factor"), ("lucid", "train_floor"),
])
def test_another_policys_option_is_an_error_too(name, foreign):
    """No silent drop: an option of some other policy is as unknown to this one."""
    assert foreign not in accepted_options(name)
    with pytest.raises(ValueError, match=foreign):
        make_policy(name, M, 0.9, **{foreign: 0.5})


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_defaults_build_and_accepted_options_are_the_params_fields(name):
    pol = make_policy(name, M, 0.9)
    assert accepted_options(name) == {f.name for f in dataclasses.fields(pol.params)}
    assert pol.params == type(pol.params)()
    with pytest.raises(dataclasses.FrozenInstanceError):
        pol.params.x = 1  # frozen


@pytest.mark.parametrize("cls, field, value", [
    (ElastiCoParams, "train_floor", 0.0),  # (0, 1]
    (ElastiCoParams, "train_floor", float("nan")),
    (ElastiCoParams, "slo_factor", 0.5),  # a margin of more than one GPU: no SLO can hold
    (ElastiCoParams, "max_attempts", 0),
    (ElastiCoParams, "max_attempts", 2.5),  # not an int
    (ElastiCoParams, "max_candidates", True),  # a bool is not a count
    (ElastiCoParams, "shares_pct", (50, 25)),  # not ascending
    (ElastiCoParams, "shares_pct", [25, 50]),  # not a tuple
    (ElastiCoParams, "shares_pct", ()),
    (ElastiCoParams, "inference_shares_pct", (0, 50)),  # (0, 100]
    (ElastiCoParams, "pricing", "yes"),  # not a bool
    (ElastiCoParams, "min_count_speed", 1.5),
    (ElastiCoParams, "work_weight", 1.5),
    (ElastiCoParams, "work_weight", -0.1),
    (ElastiCoParams, "min_run_s", -1.0),
    (TiresiasParams, "thresholds_gpu_s", (36000.0, 3600.0)),
    (TiresiasParams, "thresholds_gpu_s", (0.0,)),
    (TiresiasParams, "starve_factor", 0.0),
    (MpsEqualShareParams, "replicas", 0),
    (MpsEqualShareParams, "replicas", 2.0),
    (LucidParams, "pack_floor", 1.5),
    (LucidParams, "slo_factor", "10"),
])
def test_each_params_dataclass_rejects_a_bad_value_naming_the_field(cls, field, value):
    with pytest.raises(OptionError, match=rf"{cls.__name__}\.{field}=") as err:
        cls(**{field: value})
    assert isinstance(err.value, ValueError) and err.value.field == field


def test_make_policy_rejects_a_bad_value_naming_the_field():
    with pytest.raises(ValueError, match="train_floor"):
        make_policy("elastico", M, 0.9, train_floor=1.5)
    with pytest.raises(ValueError, match="replicas"):
        make_policy("mps-equal-share", M, 0.9, replicas=0)


def test_good_values_are_kept_as_given():
    p = ElastiCoParams(train_floor=1, min_run_s=0, shares_pct=(100,), reprice_interval_s=float("inf"))
    assert (p.train_floor, p.min_run_s, p.shares_pct) == (1, 0, (100,))
    assert Tiresias(TiresiasParams(thresholds_gpu_s=(10, 20))).thresholds_gpu_s.tolist() == [10.0, 20.0]
    assert PolicyParams() == PolicyParams()


def test_a_policy_takes_only_its_own_params_type():
    with pytest.raises(TypeError, match="ElastiCoParams"):
        ElastiCo(M, 0.9, TiresiasParams())


def test_options_for_gives_each_policy_its_part_and_refuses_a_typo():
    shared = {"train_floor": 0.5, "slo_factor": 8.0, "replicas": 3}
    assert options_for("elastico", shared) == {"train_floor": 0.5, "slo_factor": 8.0}
    assert options_for("lucid", shared) == {"slo_factor": 8.0}
    assert options_for("mps-equal-share", shared) == {"replicas": 3}
    assert options_for("exclusive-fifo", shared) == {}
    for name in POLICY_NAMES:  # what options_for gives is always accepted
        make_policy(name, M, 0.9, **options_for(name, shared))
    with pytest.raises(ValueError, match="train_flor"):
        options_for("lucid", {"train_flor": 0.5})
    with pytest.raises(ValueError, match="unknown"):
        options_for("nope", {})


def test_options_reach_the_policy():
    """The shared option set configures ElastiCo as the keyword would: two medium jobs share one GPU at the
    default training floor, not at a floor of 0.9."""
    jobs = [{"type": 1, "remaining": 3600.0}, {"type": 1, "remaining": 3600.0}]
    for floor, placed in ((None, [0, 1]), (0.9, [0])):
        opts = options_for("elastico", {} if floor is None else {"train_floor": floor})
        d = make_policy("elastico", rule_matrix(1.0), 1.0, **opts).decide(view(jobs, gpus=1))
        assert [j for j, _, _ in d.place] == placed


#: the least environment an allocator starts from
ALLOCATOR_ENV = {"ELASTICO_INSECURE": "1", "ELASTICO_REDIS_URL": "redis://h:1"}


@pytest.mark.parametrize("env, var", [
    ({"ELASTICO_TRAIN_FLOOR": "1.5"}, "ELASTICO_TRAIN_FLOOR"),
    ({"ELASTICO_MIN_COUNT_SPEED": "0"}, "ELASTICO_MIN_COUNT_SPEED"),
    ({"ELASTICO_WORK_WEIGHT": "2"}, "ELASTICO_WORK_WEIGHT"),
])
def test_allocator_settings_check_the_policy_options_naming_the_variable(env, var):
    base = ALLOCATOR_ENV
    with pytest.raises(ConfigError, match=var):
        AllocatorSettings.from_env({**base, **env})
    s = AllocatorSettings.from_env({**base, "ELASTICO_POLICY_MAX_ATTEMPTS": "32"})
    opts = {**s.policy_options(), "max_attempts": s.policy_max_attempts}
    assert make_policy("elastico", np.zeros((4, 4)), 0.9, **opts).params.max_attempts == 32


def test_the_objective_knob_reaches_the_live_policy():
    """ELASTICO_WORK_WEIGHT configures the policy the allocator builds (its default: the policy's own, 0.5)."""
    base = ALLOCATOR_ENV
    assert AllocatorSettings.from_env(base).policy_options()["work_weight"] == ElastiCoParams().work_weight == 0.5
    opts = AllocatorSettings.from_env({**base, "ELASTICO_WORK_WEIGHT": "0"}).policy_options()
    assert make_policy("elastico", np.zeros((4, 4)), 0.9, **opts).params.work_weight == 0.0


def test_unlimited_training_reaches_the_live_policy_and_is_on_by_default():
    """ELASTICO_UNLIMITED_TRAINING=0 makes every training share a compute limit in the policy the allocator builds
    (and in the engine, which reads the policy's attribute); on by default, as the simulator measures it."""
    base = ALLOCATOR_ENV
    assert AllocatorSettings.from_env(base).policy_options()["unlimited_training"] is True
    opts = AllocatorSettings.from_env({**base, "ELASTICO_UNLIMITED_TRAINING": "0"}).policy_options()
    pol = make_policy("elastico", np.zeros((4, 4)), 0.9, **opts)
    assert pol.params.unlimited_training is False and pol.unlimited_training is False
    with pytest.raises(ConfigError, match="ELASTICO_UNLIMITED_TRAINING"):
        AllocatorSettings.from_env({**base, "ELASTICO_UNLIMITED_TRAINING": "maybe"})
