"""Shape family and MPS share model, inference sizing."""

import numpy as np
import pytest

from elastico.coloc.profiles import load_type_table
from elastico.coloc.rates import share_speed
from services.allocator.policy import required_share_pct, training_shapes


@pytest.mark.parametrize("share,util,expected", [
    (100, 0.5, 1.0), (50, 0.5, 1.0), (25, 0.5, 0.5), (25, 1.0, 0.25), (75, 1.0, 0.75),
], ids=["full", "saturated-at-util", "half-of-util", "heavy-quarter", "heavy-three-quarters"])
def test_share_speed_saturates_at_solo_util(share, util, expected):
    assert share_speed(share, util) == pytest.approx(expected)


@pytest.mark.parametrize("util,floor,shares", [
    (0.3, 0.5, [25, 50, 75, 100]), (1.0, 0.5, [50, 75, 100]), (1.0, 0.9, [100]),
], ids=["light-all", "heavy-floor-half", "strict-floor"])
def test_training_shapes_respect_floor(util, floor, shares):
    got = training_shapes(2, util, 10.0, min_speed=floor, gpu_type="v100")
    assert [s.compute_share_pct for s in got] == shares
    assert all(s.num_gpus == 2 and s.mem_mib == 16384 * s.compute_share_pct // 100 for s in got)
    assert got[-1].throughput == pytest.approx(10.0)


@pytest.mark.parametrize("load,nu,expected", [
    (0.1, 1.0, 25), (0.2, 1.0, 50), (0.6, 1.0, 75), (0.9, 1.0, 100), (0.3, 0.5, 100), (2.0, 1.0, 100),
], ids=["tiny", "small", "medium", "peak", "interfered", "overload-caps-at-100"])
def test_inference_share_meets_slo(load, nu, expected):
    assert required_share_pct(np.array([load]), 10.0, nu)[0] == expected


def test_type_table_fits_utilisation_from_measured_pairs():
    t = load_type_table()
    assert t.names[-1] == "inference"
    u = dict(zip(t.names, t.solo_util))
    assert 0.05 <= min(t.solo_util[:-1]) and max(t.solo_util[:-1]) <= 1.0
    assert u["ResNet-18 (batch size 16)"] < u["ResNet-50 (batch size 64)"]  # small CNN batch uses less


# --------------------------------------------------------------------------------------------------
# Declared shapes (JobSpec.shapes) in the policy's view


def with_declared(v, shapes: dict):
    """``v`` with jobs declaring shapes (``{job row: (Shape, ...)}``), as ``plan.build_view`` builds it: the
    declared shapes in the view and a declaring training job's utilisation capped at its largest share."""
    from dataclasses import fields, replace

    from services.allocator.policy.shapes import DeclaredJobTable, declared_util_cap

    t = v.jobs
    util = t.solo_util.copy()
    for j, sh in shapes.items():
        if t.kind[j] == 0:
            util[j] = min(util[j], declared_util_cap(sh))
    table = DeclaredJobTable(**{f.name: getattr(t, f.name) for f in fields(t)},
                             declared=tuple(tuple(shapes.get(j, ())) for j in range(len(t.kind))),
                             any_declared=bool(shapes))
    return replace(v, jobs=replace(table, solo_util=util))


def test_declared_share_is_the_declared_one_nearest_the_policys_from_above():
    from elastico.domain import Shape
    from services.allocator.policy.shapes import declared_options, declared_share, declared_util_cap, shapes_of

    from ._policy_builders import view

    v = with_declared(view([{}, {}, {}], gpus=2), {0: (Shape(1, 10.0, 1024),),
                                                   1: (Shape(2, 40.0, 5000), Shape(1, 30.0, 3000), Shape(1, 60.0, 7000))})
    j = v.jobs
    assert declared_share(j, 0, 1, 100.0) == 10.0 and declared_share(j, 0, 1, 5.0) == 10.0
    assert declared_share(j, 0, 2, 100.0) is None  # no 2-GPU shape declared: no placement on 2 GPUs
    assert [declared_share(j, 1, 1, w) for w in (25.0, 50.0, 100.0)] == [30.0, 60.0, 60.0]
    assert declared_share(j, 1, 2, 50.0) == 40.0
    assert declared_share(j, 2, 1, 50.0) == 50.0 and shapes_of(j, 2) == ()  # no shapes: the policy's own
    assert declared_options(j, 1) == ((2, 40.0), (1, 30.0), (1, 60.0))  # requested gang first, shares ascending
    assert declared_util_cap(j.declared[1]) == pytest.approx(0.6) and declared_util_cap(()) == np.inf
    assert shapes_of(view([{}], gpus=1).jobs, 0) == ()  # the simulator's plain JobTable declares nothing
