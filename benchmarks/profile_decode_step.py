"""Where a decode step's checks spend their time, operation by operation (``torch.profiler``).

The engine suite's Mellum decode step (``_decode_model.py``: 4 layers, 3 sliding-window and 1 full,
16 requests x 160 tokens, float32, eager, torch on one thread), with every check on, profiled over
``--steps`` steps of each kind:

* not sampled: the stamps and every layer's checksums (the write path every forward step pays);
* sampled: the same, the write check and the read check in the layers, and the provenance
  verification of the sample (``KvProvenance.stage``: the batch's live slots of both pools).

Prints, per kind, the device operations of one step (``TorchDispatchMode``, views left out) and the
profiler's table of the aten operations by self CPU time, with the same step without otel-swa's
checks for scale (its operations are the model's own: matmuls, the attention's gathers, the KV
stores).

Run: ``python benchmarks/profile_decode_step.py [--steps 100] [--rows 15]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, one_thread  # noqa: E402
from _decode_model import SHAPES, DecodeModel  # noqa: E402
from bench_provenance import sampled_decode_step  # noqa: E402
from bench_sample import kernel_ops  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rows", type=int, default=15)
    args = parser.parse_args()
    one_thread()
    print(machine_line())
    from torch.profiler import ProfilerActivity, profile

    shape = SHAPES[0]
    plain = DecodeModel(shape, "cpu", checks=False)
    quiet = DecodeModel(shape, "cpu", checks=True)
    quiet.reporter.gate.set(False)
    sampled_step = sampled_decode_step(DecodeModel(shape, "cpu", checks=True))

    steps = {"no otel-swa": plain.forward, "not sampled": quiet.forward, "sampled": sampled_step}
    for name, step in steps.items():
        for _ in range(5):
            step()
        ops = kernel_ops(step)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
        averages = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in averages) / args.steps
        print(f"\n{name}: {ops} device operations a step, {total:.0f} us of aten self CPU time a step "
              f"(profiled, {args.steps} steps)")
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
