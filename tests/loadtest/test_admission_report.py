"""The admission evaluation's pure parts (`loadtest.admission_report`, `loadtest.plots`): the saturation
finder, the targets and the table, on synthetic points; no cluster."""
from __future__ import annotations

import pytest

from loadtest.admission_report import Point, format_table, format_targets, saturation_rate, targets


def point(policy: str, load: float, goodput: float, attainment: float = 1.0, rejected: float = 0.0) -> Point:
    return Point(policy, 10.0 * load, load, goodput, attainment, rejected, goodput, 100.0 * load)


def test_saturation_is_the_best_rate_before_goodput_stops_growing():
    # Grows ×1.5 per step up to 9 req/s, then +5% (less than the 10% that counts), then falls.
    climb = [(4.0, 4.0), (6.0, 6.0), (9.0, 8.9), (13.5, 9.3), (20.25, 5.0)]
    assert saturation_rate(climb) == 9.0
    assert saturation_rate(climb[:3]) is None  # still growing: the climb must go on
    assert saturation_rate(climb, min_gain=0.01) == 13.5
    assert saturation_rate([(9.0, 8.9), (4.0, 4.0), (6.0, 6.0), (13.5, 9.3)]) == 9.0  # order does not matter


def test_a_noisy_dip_below_the_best_ends_the_climb_at_the_best():
    assert saturation_rate([(4.0, 4.0), (6.0, 3.0), (9.0, 9.0)]) == 4.0


def test_targets_at_the_highest_load():
    points = [point("always", 1.0, 9.0), point("predictive", 1.0, 10.0),
              point("always", 3.0, 2.0, 0.1), point("predictive", 3.0, 8.5, 0.3, 0.7)]
    result = targets(points)
    assert result["load"] == 3.0
    assert result["keep_share"] == pytest.approx(0.85) and result["keep_share_met"]
    assert result["vs_always"] == pytest.approx(4.25) and result["vs_always_met"]
    missed = targets([point("always", 3.0, 4.0), point("predictive", 3.0, 7.0), point("predictive", 1.0, 10.0)])
    assert (missed["keep_share_met"], missed["vs_always_met"]) == (False, False)
    assert "70% of its peak" in format_targets(missed) and "NOT met" in format_targets(missed)
    assert targets([point("always", 3.0, 0.0), point("predictive", 3.0, 1.0)])["vs_always"] == float("inf")


def test_table_rows_go_by_load_always_first():
    table = format_table([point("predictive", 3.0, 8.5, 0.3, 0.7), point("always", 3.0, 2.0, 0.1),
                          point("always", 1.0, 9.0)])
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["load", "rate/s", "policy", "goodput/s"]
    assert [line.split()[2] for line in lines[1:]] == ["always", "always", "predictive"]
    assert lines[3].split() == ["3.00", "30.00", "predictive", "8.50", "30%", "70%", "8.50", "300", "0"]
    assert lines[0].split()[-1] == "failed"


def test_policy_comparison_plots_are_small_pngs(tmp_path):
    from loadtest.plots import plot_policy_comparison

    points = [point(p, load, g) for p, load, g in (("always", 0.5, 5), ("always", 3, 1), ("predictive", 0.5, 5),
                                                   ("predictive", 3, 9))]
    written = plot_policy_comparison(points, tmp_path, saturation_per_s=10.0)
    assert [p.name for p in written] == ["admission_goodput_vs_load.png", "admission_attainment_vs_load.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" and p.stat().st_size < 200_000 for p in written)
