"""The command line does not import torch unless a command needs the engine (``replay``).

Each check runs in a fresh interpreter, so modules imported by other tests do not count.
"""

import subprocess
import sys

RECORD = 'kv_canary_swa_divergence={"forward_ct":20,"verify_full":90,"verify_swa":40,"swa_full_idx_divergence":3,"swa_out_of_window_tokens":5}'


def _torch_imported(code: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_building_the_parser_does_not_import_torch():
    code = "import otel_swa.cli, sys; otel_swa.cli.build_parser(); print('torch' in sys.modules)"
    assert _torch_imported(code) == "False"


def test_check_on_a_small_log_does_not_import_torch(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(f"[2025-06-01 12:34:56 TP0] {RECORD}\n")
    code = (
        "import sys, otel_swa.cli\n"
        "code = otel_swa.cli.main(['check', sys.argv[1]])\n"
        "print(code)\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(log)], capture_output=True, text=True, timeout=60)
    lines = proc.stdout.strip().splitlines()
    assert lines[-2:] == ["0", "False"], proc.stdout + proc.stderr


def test_old_import_paths_still_give_the_same_objects():
    from otel_swa.reference import config as ref_config
    from otel_swa.reference.engine import EngineConfig
    from otel_swa.reference.replay import ARRIVALS, DEFAULT_REPLAY, ReplayDefaults

    assert EngineConfig is ref_config.EngineConfig
    assert ReplayDefaults is ref_config.ReplayDefaults
    assert DEFAULT_REPLAY is ref_config.DEFAULT_REPLAY
    assert ARRIVALS == ("ignore", "compress")
    assert (DEFAULT_REPLAY.trace, DEFAULT_REPLAY.limit, DEFAULT_REPLAY.interval) == ("conv", 200, 20)
    assert DEFAULT_REPLAY.config.window == 128
