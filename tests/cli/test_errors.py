"""Unusable input gives exit status 2 and one clear line on stderr, never a traceback."""

import pytest

from otel_swa.cli import main
from otel_swa.config import ConfigError

RUN = ["replay", "--requests", "3", "--no-model", "--no-progress"]
RECORD = (
    '[2025-06-01 12:34:56 TP0] kv_canary_swa_divergence={"forward_ct":20,"verify_full":90,"verify_swa":40,'
    '"swa_full_idx_divergence":3,"swa_out_of_window_tokens":5}\n'
)


def _one_line_error(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("value, message", [
    ("100000000000", "OTEL_SWA_RING_SIZE='100000000000' is above 1024; expected an integer from 1 to 1024"),
    ("1025", "OTEL_SWA_RING_SIZE='1025' is above 1024; expected an integer from 1 to 1024"),
    ("0", "OTEL_SWA_RING_SIZE='0' is below 1; expected an integer from 1 to 1024"),
])
def test_ring_size_from_env_is_bounded_before_any_allocation(value, message):
    from otel_swa.reporter import SwaDivergenceReporter

    with pytest.raises(ConfigError) as info:
        SwaDivergenceReporter.from_env(environ={"OTEL_SWA_DIVERGENCE_INTERVAL": "20", "OTEL_SWA_RING_SIZE": value})
    assert str(info.value) == message


def test_ring_size_at_the_maximum_is_accepted():
    from otel_swa.config import ring_size

    assert ring_size({"OTEL_SWA_RING_SIZE": "1024"}) == 1024
