"""The numbers the plot draws: the verify lag per interval."""

import pytest

from otel_swa.plot import plot_records, verify_lag_per_interval
from otel_swa.record import SwaDivergenceRecord as R


def test_verify_lag_per_interval_against_hand_values():
    records = [R(20, 1000, 400, 0, 0), R(40, 2100, 800, 0, 0), R(60, 2500, 900, 0, 0)]
    # lags 600, 1300, 1600 -> per interval 700, 300
    assert verify_lag_per_interval(records) == [(20, 40, 700), (40, 60, 300)]


def test_restarted_reporter_starts_a_new_series():
    records = [R(20, 100, 40, 0, 0), R(40, 300, 100, 0, 0), R(20, 50, 30, 0, 0), R(40, 90, 40, 0, 0)]
    assert verify_lag_per_interval(records) == [(20, 40, 140), (20, 40, 30)]
    assert verify_lag_per_interval(records[:1]) == []


def test_plot_records_rejects_empty_and_wrong_items(tmp_path):
    with pytest.raises(ValueError, match="no record to plot"):
        plot_records({"TP0": []}, tmp_path / "a.png")
    with pytest.raises(TypeError, match="rank 'TP0': expected SwaDivergenceRecord items, got dict"):
        plot_records({"TP0": [{"forward_ct": 1}]}, tmp_path / "a.png")
