"""Elastic shadow pricing (services/pricer/core/) against its contract and the exact MILP reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from services.pricer.core import (
    PricingInputError,
    PricingProblem,
    SolverOptions,
    SolveStatus,
    allocation_load,
    allocation_value,
    best_response,
    dual_bound,
    relative_gap,
    solve,
)
from services.pricer.milp import solve_milp

# ----------------------------------------------------------------------------------------------------
# builders


def problem(utility, demand, capacity, mask=None) -> PricingProblem:
    """A problem from nested lists; ``mask`` defaults to every shape valid."""
    u = np.asarray(utility, dtype=float)
    d = np.asarray(demand, dtype=float)
    m = np.ones(u.shape, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    return PricingProblem(utility=u, demand=d, mask=m, capacity=np.asarray(capacity, dtype=float))


def random_problem(seed: int, jobs: int, shapes: int, pools: int, tightness: float = 0.4) -> PricingProblem:
    """Sparse random demands, utilities loosely proportional to size, padded shapes masked out."""
    rng = np.random.default_rng(seed)
    d = rng.uniform(0, 1, (jobs, shapes, pools)) * (rng.uniform(size=(jobs, shapes, pools)) < 0.6)
    u = d.sum(axis=2) * rng.uniform(0.5, 1.5, (jobs, shapes)) + rng.uniform(0, 0.2, (jobs, shapes))
    m = rng.uniform(size=(jobs, shapes)) < 0.85
    cap = np.maximum(d.max(axis=1).sum(axis=0) * tightness, 0.5)
    u[~m] = np.nan  # padding may hold anything: it must never be read
    return PricingProblem(utility=u, demand=d, mask=m, capacity=cap)


def many_small_jobs(seed: int, jobs: int = 400) -> PricingProblem:
    """Thousands-of-jobs regime in miniature: every shape uses < 2% of a pool, so the LP is nearly integral."""
    rng = np.random.default_rng(seed)
    shapes, pools = 4, 3
    d = rng.uniform(0.0, 1.0, (jobs, shapes, pools))
    u = d.sum(axis=2) * rng.uniform(0.5, 1.5, (jobs, shapes))
    cap = d.mean(axis=(0, 1)) * jobs * 0.3  # ~30% of jobs fit; one shape is ~1/120 of a pool
    return PricingProblem(utility=u, demand=d, mask=np.ones((jobs, shapes), bool), capacity=cap)


def assert_feasible(p: PricingProblem, choice: np.ndarray) -> None:
    assert choice.shape == (p.num_jobs,)
    assert np.all((choice >= -1) & (choice < max(p.num_shapes, 1)))
    on = choice >= 0
    assert np.all(np.asarray(p.mask)[np.flatnonzero(on), choice[on]])  # only existing shapes
    load = allocation_load(p, choice)
    assert np.all(load <= np.asarray(p.capacity)), (load, p.capacity)
    # and again with an independent loop, summed another way
    manual = np.zeros(p.num_pools)
    for j in np.flatnonzero(on):
        manual += np.asarray(p.demand)[j, choice[j]]
    assert np.all(manual <= np.asarray(p.capacity) * (1 + 1e-12) + 1e-12)


def assert_certificate(p: PricingProblem, res, opts: SolverOptions | None = None) -> None:
    """The result's contract, ``opts`` being the options it was solved with."""
    assert res.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE)
    assert_feasible(p, res.choice)
    assert res.primal_value == pytest.approx(allocation_value(p, res.choice), rel=1e-12, abs=1e-12)
    assert res.dual_bound >= res.primal_value
    assert res.gap >= 0.0
    assert res.gap == pytest.approx(relative_gap(res.primal_value, res.dual_bound), rel=1e-9, abs=1e-15)
    assert np.all(res.prices >= 0.0) and np.all(np.isfinite(res.prices))
    # the reported prices certify the reported bound (up to float noise)
    assert dual_bound(p, res.prices) <= res.dual_bound * (1 + 1e-9) + 1e-9
    # OPTIMAL exactly when the gap is within the requested tolerance
    assert (res.status is SolveStatus.OPTIMAL) is (res.gap <= (opts or SolverOptions()).gap_tolerance)


# ----------------------------------------------------------------------------------------------------
# validation: a ValueError naming the field; solve() turns it into status data


def _shape_bad(field):
    u = np.ones((2, 2))
    d = np.ones((2, 2, 1))
    m = np.ones((2, 2), bool)
    c = np.ones(1)
    if field == "utility-1d":
        return PricingProblem(np.ones(2), d, m, c)
    if field == "mask-shape":
        return PricingProblem(u, d, np.ones((2, 3), bool), c)
    if field == "mask-dtype":
        return PricingProblem(u, d, np.ones((2, 2)), c)
    if field == "demand-shape":
        return PricingProblem(u, np.ones((2, 2, 2)), m, c)
    if field == "capacity-2d":
        return PricingProblem(u, d, m, np.ones((1, 1)))
    raise AssertionError(field)


BAD = [
    ("nan-utility", lambda: problem([[np.nan, 1.0]], [[[1.0], [1.0]]], [1.0]), "utility"),
    ("negative-utility", lambda: problem([[-1.0, 1.0]], [[[1.0], [1.0]]], [1.0]), "utility"),
    ("inf-utility", lambda: problem([[np.inf, 1.0]], [[[1.0], [1.0]]], [1.0]), "utility"),
    ("nan-demand", lambda: problem([[1.0, 1.0]], [[[np.nan], [1.0]]], [1.0]), "demand"),
    ("negative-demand", lambda: problem([[1.0, 1.0]], [[[-0.5], [1.0]]], [1.0]), "demand"),
    ("inf-demand", lambda: problem([[1.0, 1.0]], [[[np.inf], [1.0]]], [1.0]), "demand"),
    ("nan-capacity", lambda: problem([[1.0]], [[[1.0, 1.0]]], [np.nan, 1.0]), "capacity"),
    ("negative-capacity", lambda: problem([[1.0]], [[[1.0]]], [-1.0]), "capacity"),
    ("inf-capacity", lambda: problem([[1.0]], [[[1.0]]], [np.inf]), "capacity"),
    ("no-pools", lambda: problem(np.ones((1, 1)), np.ones((1, 1, 0)), np.ones(0)), "capacity"),
    ("all-pools-empty", lambda: problem([[1.0]], [[[1.0, 1.0]]], [0.0, 0.0]), "capacity"),
    ("utility-1d", lambda: _shape_bad("utility-1d"), "utility"),
    ("mask-wrong-shape", lambda: _shape_bad("mask-shape"), "mask"),
    ("mask-not-bool", lambda: _shape_bad("mask-dtype"), "mask"),
    ("demand-wrong-shape", lambda: _shape_bad("demand-shape"), "demand"),
    ("capacity-2d", lambda: _shape_bad("capacity-2d"), "capacity"),
]


@pytest.mark.parametrize("make,field", [(m, f) for _, m, f in BAD], ids=[i for i, _, _ in BAD])
def test_validation_names_the_field(make, field):
    p = make()
    with pytest.raises(PricingInputError) as err:
        p.validate()
    assert isinstance(err.value, ValueError)
    assert err.value.field == field
    assert field in str(err.value)
    res = solve(p)
    assert res.status is SolveStatus.INFEASIBLE_INPUT
    assert res.error_field == field
    assert np.all(res.choice == -1)
    exact = solve_milp(p)
    assert exact.status is SolveStatus.INFEASIBLE_INPUT and exact.error_field == field


def test_padding_is_never_read():
    p = problem([[1.0, np.nan]], [[[1.0], [np.nan]]], [1.0], mask=[[True, False]])
    p.validate()
    res = solve(p)
    assert res.choice.tolist() == [0] and res.status is SolveStatus.OPTIMAL


@pytest.mark.parametrize(
    "kwargs,field",
    [({"gap_tolerance": -1.0}, "options.gap_tolerance"), ({"method": "magic"}, "options.method"),
     ({"time_limit_s": 0.0}, "options.time_limit_s"), ({"smoothing_decay": 1.0}, "options.smoothing_decay")],
    ids=["negative-tolerance", "unknown-method", "zero-time-limit", "decay-not-shrinking"],
)
def test_bad_options_name_the_field(kwargs, field):
    with pytest.raises(PricingInputError) as err:
        SolverOptions(**kwargs)
    assert err.value.field == field


def test_bad_warm_prices_are_reported_as_input():
    p = problem([[1.0]], [[[1.0]]], [1.0])
    res = solve(p, warm_prices=np.array([-1.0]))
    assert res.status is SolveStatus.INFEASIBLE_INPUT and res.error_field == "warm_prices"


# ----------------------------------------------------------------------------------------------------
# small exact cases


CASES = [
    # id, utility, demand, capacity, mask, optimal value, optimal choice (None: any optimum)
    ("everything-fits", [[1.0, 2.0], [3.0, 1.0]], [[[1.0], [2.0]], [[1.0], [1.0]]], [10.0], None, 5.0, [1, 0]),
    ("knapsack-one-pool", [[6.0], [10.0], [12.0]], [[[1.0]], [[2.0]], [[3.0]]], [5.0], None, 22.0, [-1, 0, 0]),
    ("downgrade-to-fit", [[10.0, 7.0], [10.0, 7.0]], [[[2.0], [1.0]], [[2.0], [1.0]]], [3.0], None, 17.0, None),
    ("two-pools", [[5.0, 4.0], [5.0, 4.0]], [[[1.0, 0.0], [0.0, 1.0]], [[1.0, 0.0], [0.0, 1.0]]], [1.0, 1.0],
     None, 9.0, None),
    ("never-fits", [[5.0], [1.0]], [[[9.0]], [[1.0]]], [2.0], None, 1.0, [-1, 0]),
    ("zero-capacity-pool", [[5.0, 1.0]], [[[1.0, 1.0], [0.0, 1.0]]], [0.0, 1.0], None, 1.0, [1]),
    ("masked-best-shape", [[100.0, 1.0]], [[[1.0], [1.0]]], [1.0], [[False, True]], 1.0, [1]),
    ("zero-utility-waits", [[0.0], [0.0]], [[[1.0]], [[1.0]]], [1.0], None, 0.0, [-1, -1]),
    ("no-shapes-at-all", np.zeros((2, 0)), np.zeros((2, 0, 1)), [1.0], None, 0.0, [-1, -1]),
    ("no-jobs", np.zeros((0, 3)), np.zeros((0, 3, 2)), [1.0, 1.0], None, 0.0, []),
]


@pytest.mark.parametrize("u,d,c,mask,value,choice", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_small_cases_reach_the_optimum(u, d, c, mask, value, choice):
    p = problem(u, d, c, mask)
    opts = SolverOptions(gap_tolerance=0.0)
    res = solve(p, opts)
    assert_certificate(p, res, opts)
    assert res.primal_value == pytest.approx(value)
    if choice is not None:
        assert res.choice.tolist() == choice
    exact = solve_milp(p)
    assert exact.status is SolveStatus.OPTIMAL and exact.primal_value == pytest.approx(value)


def test_never_fits_flags_jobs_that_no_cluster_state_can_admit():
    p = problem([[5.0, 6.0], [1.0, 1.0]], [[[9.0], [8.0]], [[1.0], [9.0]]], [2.0])
    res = solve(p)
    assert res.never_fits.tolist() == [True, False]


# ----------------------------------------------------------------------------------------------------
# helpers agree with the solver


def test_best_response_and_dual_bound_agree():
    p = random_problem(3, 60, 4, 3)
    prices = np.array([0.3, 0.1, 0.7])
    br = best_response(p, prices)
    u = np.where(p.mask, p.utility, 0.0)
    margin = np.array([u[j, s] - p.demand[j, s] @ prices if s >= 0 else 0.0 for j, s in enumerate(br)])
    assert np.all(margin >= 0.0)
    assert dual_bound(p, prices) == pytest.approx(margin.sum() + prices @ p.capacity)


@pytest.mark.parametrize("seed", [0, 1, 2], ids=["seed0", "seed1", "seed2"])
def test_any_prices_bound_the_exact_optimum(seed):
    p = random_problem(seed, 25, 3, 2)
    exact = solve_milp(p)
    assert exact.status is SolveStatus.OPTIMAL
    for prices in (np.zeros(2), np.ones(2), np.array([5.0, 0.0]), solve(p).prices):
        assert dual_bound(p, prices) >= exact.primal_value - 1e-9


# ----------------------------------------------------------------------------------------------------
# properties on random instances


dims = st.tuples(
    st.integers(min_value=0, max_value=2**31 - 1),  # seed
    st.integers(min_value=1, max_value=40),  # jobs
    st.integers(min_value=1, max_value=5),  # shapes
    st.integers(min_value=1, max_value=4),  # pools
    st.floats(min_value=0.05, max_value=1.2),  # tightness
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dims, st.sampled_from(["elastic", "subgradient"]))
def test_capacity_never_exceeded_and_certificate_holds(d, method):
    p = random_problem(*d)
    opts = SolverOptions(method=method, max_iterations=60)
    res = solve(p, opts)
    assert_certificate(p, res, opts)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dims)
@example(d=(1, 24, 5, 1, 0.44922183252753606))  # HiGHS' allocation over capacity by its tolerance: repaired, not proved
def test_primal_le_milp_le_dual_bound(d):
    p = random_problem(*d)
    res = solve(p, SolverOptions(gap_tolerance=1e-4))
    exact = solve_milp(p, time_limit_s=20.0)
    assert exact.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE)  # some draws take HiGHS > 20 s to prove
    assert_feasible(p, exact.choice)
    tol = 1e-9 * max(1.0, abs(exact.primal_value))
    # neither allocation beats the other's bound on the optimum
    assert res.primal_value <= exact.dual_bound + tol
    assert exact.primal_value <= res.dual_bound + tol
    if exact.status is SolveStatus.OPTIMAL:  # proved: the MILP's allocation is the optimum
        assert res.primal_value <= exact.primal_value + tol


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dims, st.sampled_from([None, 0.5, 2.0]))
def test_deterministic_and_warm_start_keeps_the_contract(d, warm_scale):
    p = random_problem(*d)
    a, b = solve(p), solve(p)
    assert np.array_equal(a.choice, b.choice)
    assert np.array_equal(a.prices, b.prices)
    assert (a.primal_value, a.dual_bound, a.iterations, a.status) == (b.primal_value, b.dual_bound, b.iterations,
                                                                       b.status)
    warm = None if warm_scale is None else a.prices * warm_scale
    assert_certificate(p, solve(p, warm_prices=warm))


@pytest.mark.parametrize("seed", [11, 12, 13], ids=["seed11", "seed12", "seed13"])
def test_gap_goes_to_zero_where_the_lp_relaxation_is_tight(seed):
    # at most R jobs are fractional in an LP optimum: with more (and smaller) jobs the gap must shrink
    small, large = many_small_jobs(seed, jobs=400), many_small_jobs(seed, jobs=3000)
    opts = SolverOptions(gap_tolerance=1e-5, max_iterations=400)
    res_small, res_large = solve(small, opts), solve(large, opts)
    assert_certificate(small, res_small, opts)
    assert_certificate(large, res_large, opts)
    assert res_small.gap <= 2e-3
    assert res_large.gap <= 2e-4, res_large.gap  # 0.02% of the LP bound: nothing left worth finding
    assert res_large.gap < res_small.gap


def test_solve_leaves_its_input_untouched():
    p = random_problem(9, 30, 1, 1)  # shapes whose transposes are views: no in-place work may leak
    before = [np.array(a, copy=True) for a in (p.utility, p.demand, p.mask, p.capacity)]
    solve(p)
    solve_milp(p)
    for old, new in zip(before, (p.utility, p.demand, p.mask, p.capacity)):
        assert np.array_equal(old, new, equal_nan=True)


def test_warm_start_from_own_prices_converges_in_fewer_iterations():
    p = many_small_jobs(21, jobs=600)
    cold = solve(p, SolverOptions(gap_tolerance=1e-3))
    warm = solve(p, SolverOptions(gap_tolerance=1e-3), warm_prices=cold.prices)
    assert_certificate(p, warm)
    assert warm.gap <= 1e-3
    assert warm.iterations <= cold.iterations


def test_subgradient_method_is_slower_but_sound():
    p = many_small_jobs(5)
    res = solve(p, SolverOptions(method="subgradient", max_iterations=300, gap_tolerance=1e-3))
    assert_certificate(p, res)
    assert res.status is SolveStatus.OPTIMAL  # sound: reaches the tolerance within its iteration budget
    assert res.iterations > solve(p, SolverOptions(gap_tolerance=1e-3)).iterations  # slower: more price updates


def test_large_round_uses_the_coarse_warm_start_and_stays_feasible():
    rng = np.random.default_rng(4)
    jobs, shapes, pools = 12000, 3, 3
    d = rng.uniform(0.0, 1.0, (jobs, shapes, pools))
    u = d.sum(axis=2) * rng.uniform(0.5, 1.5, (jobs, shapes))
    p = PricingProblem(u, d, np.ones((jobs, shapes), bool), d.mean(axis=(0, 1)) * jobs * 0.3)
    res = solve(p)
    assert_certificate(p, res)
    assert res.status is SolveStatus.OPTIMAL and res.gap <= 1e-3


def test_milp_reports_time_limit_as_feasible():
    p = random_problem(7, 200, 6, 6, tightness=0.3)
    exact = solve_milp(p, time_limit_s=0.05)
    assert exact.status in (SolveStatus.FEASIBLE, SolveStatus.OPTIMAL)
    assert_feasible(p, exact.choice)
    assert exact.dual_bound >= exact.primal_value
