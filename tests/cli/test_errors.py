"""Unusable input gives exit status 2 and one clear line on stderr, never a traceback."""

import pytest
from cli_support import one_line_error as _one_line_error

from otel_swa.cli import main
from otel_swa.config import ConfigError

RUN = ["replay", "--requests", "3", "--no-model", "--no-progress"]


@pytest.mark.parametrize("value, message", [
    ("100000000000", "OTEL_SWA_RING_SIZE='100000000000': expected an integer from 1 to 1024"),
    ("1025", "OTEL_SWA_RING_SIZE='1025': expected an integer from 1 to 1024"),
    ("0", "OTEL_SWA_RING_SIZE='0': expected an integer from 1 to 1024"),
])
def test_ring_size_from_env_is_bounded_before_any_allocation(value, message):
    from otel_swa.reporter import SwaDivergenceReporter

    with pytest.raises(ConfigError) as info:
        SwaDivergenceReporter.from_env(environ={"OTEL_SWA_DIVERGENCE_INTERVAL": "20", "OTEL_SWA_RING_SIZE": value})
    assert str(info.value) == message


def test_ring_size_at_the_maximum_is_accepted():
    from otel_swa.config import ring_size

    assert ring_size({"OTEL_SWA_RING_SIZE": "1024"}) == 1024


def test_replay_log_file_in_a_missing_folder(capsys, tmp_path):
    missing = tmp_path / "no-such-folder" / "x.log"
    assert main(RUN + ["--log-file", str(missing)]) == 2
    assert _one_line_error(capsys) == (
        f"otel-swa replay: --log-file {str(missing)!r} cannot be opened for appending: No such file or directory"
    )
    assert capsys.readouterr().out == ""


def test_replay_bad_exemplar_filter_names_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("OTEL_METRICS_EXEMPLAR_FILTER", "nope")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert main(RUN + ["--exporter", "console"]) == 2
    line = _one_line_error(capsys)
    assert line.startswith("otel-swa replay: OpenTelemetry cannot be set up from the environment: ")
    assert "'nope'" in line
    assert line.endswith("(OTEL_METRICS_EXEMPLAR_FILTER expects always_on, always_off or trace_based)")


@pytest.mark.parametrize("option", ["--full-pool", "--swa-pool"])
def test_replay_pool_larger_than_any_memory_names_the_option(capsys, option):
    # 10**13 slots need hundreds of TiB: refused before the engine allocates anything
    assert main(RUN + [option, "10000000000000"]) == 2
    line = _one_line_error(capsys)
    assert line.startswith(f"otel-swa replay: {option} 10000000000000 slots is too large for this machine's memory")
    assert line.endswith(f"lower {option}")


def test_replay_pool_estimate_counts_free_lists_mapping_and_kv_entries(monkeypatch, capsys):
    from otel_swa.commands import replay as replay_command

    # --no-model: per FULL slot 36 (free list) + 8 (mapping), per SWA slot 36 bytes.
    # 65536 * 44 + 1_000_000 * 36 = 38,883,584 bytes; 38,000,000 available is too little.
    monkeypatch.setattr(replay_command, "_available_memory", lambda: 38_000_000)
    assert main(RUN + ["--swa-pool", "1000000"]) == 2
    line = _one_line_error(capsys)
    assert line == (
        "otel-swa replay: --swa-pool 1000000 slots is too large for this machine's memory: the KV pools need "
        "about 37.1 MiB of host memory, 36.2 MiB is available; lower --swa-pool"
    )
    monkeypatch.setattr(replay_command, "_available_memory", lambda: 38_883_584)
    assert main(RUN + ["--swa-pool", "8192"]) == 0


def test_replay_allocation_error_in_the_engine_names_the_larger_pool(monkeypatch, capsys):
    import otel_swa.reference.replay as reference_replay

    def failing_replay(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 80000000000016 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(reference_replay, "replay", failing_replay)
    assert main(RUN + ["--full-pool", "100000"]) == 2
    assert _one_line_error(capsys) == (
        "otel-swa replay: cannot allocate the KV pools (an allocation of 80,000,000,000,016 bytes failed): "
        "--full-pool 100000 slots is too large for this machine's memory; lower --full-pool"
    )


def test_replay_other_runtime_errors_are_not_disguised(monkeypatch):
    import otel_swa.reference.replay as reference_replay

    def failing_replay(*args, **kwargs):
        raise RuntimeError("index out of range in self")

    monkeypatch.setattr(reference_replay, "replay", failing_replay)
    with pytest.raises(RuntimeError, match="index out of range"):
        main(RUN)
