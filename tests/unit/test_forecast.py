"""The demand forecaster's binning of reports from more than one source (services.allocator.policy.forecast)."""

from __future__ import annotations

import math

import pytest

from elastico.domain import DemandReport
from services.allocator import demand
from services.allocator.policy.forecast import BIN_S, forecast_rps

MINUTE_RATES = (1.0, 9.0, 1.0, 2.0)  # a one-minute burst in the second minute


def _gateway_and_scrape(scale: float = 1.0) -> list[DemandReport]:
    """The same arrivals measured by a gateway on minute boundaries and by a scrape offset by half a minute
    (each scrape window holds half of two minutes), on the wall clock of a ``scale`` x accelerated run."""
    gw = [DemandReport("s", (i + 1) * BIN_S / scale, BIN_S / scale, r * scale, source="api:gw")
          for i, r in enumerate(MINUTE_RATES)]
    halves = [(a + b) / 2 for a, b in zip(MINUTE_RATES, MINUTE_RATES[1:])]
    scrape = [DemandReport("s", (i + 1.5) * BIN_S / scale, BIN_S / scale, r * scale, source="node:n1")
              for i, r in enumerate(halves)]
    return sorted(gw + scrape, key=lambda r: r.window_end_s)


@pytest.mark.parametrize("scale", [1.0, 200.0])
def test_a_burst_one_source_saw_whole_is_not_averaged_away_by_another_sources_misaligned_window(scale):
    reports = _gateway_and_scrape(scale)
    now = len(MINUTE_RATES) * BIN_S / scale + 1e-3
    assert demand.forecast(reports, now, 3600.0, scale) == pytest.approx(max(MINUTE_RATES))
    # either source alone forecasts what it measured
    gw = [r for r in reports if r.source == "api:gw"]
    node = [r for r in reports if r.source == "node:n1"]
    assert demand.forecast(gw, now, 3600.0, scale) == pytest.approx(9.0)
    assert demand.forecast(node, now, 3600.0, scale) == pytest.approx(5.0)


def test_within_one_source_a_bin_is_the_window_weighted_mean():
    t = [10.0, 20.0, 30.0]
    assert forecast_rps(t, [30.0, 10.0, 4.0], 40.0, weights=[1.0, 9.0, 10.0], sources=["a", "a", "b"]) \
        == pytest.approx((30.0 + 90.0) / 10)
    assert forecast_rps(t, [30.0, 10.0, 4.0], 40.0, weights=[1.0, 9.0, 10.0]) == pytest.approx((30 + 90 + 40) / 20)


def test_no_report_in_the_window_is_nan():
    assert math.isnan(forecast_rps([0.0], [5.0], 7200.0, window_s=3600.0, sources=["a"]))
    assert math.isnan(forecast_rps([], [], 0.0, sources=[]))
