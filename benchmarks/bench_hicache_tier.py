"""Cost of following the KV's provenance to a host tier (``otel_swa.device.host_tier``): the moves of
the stamps and checksum folds with each HiCache backup and load, per transferred token, side by side
with the same transfer without them (provenance off); the host tables' memory per host slot.

Prints (median over interleaved rounds, spread min - max; torch on one thread, CPU tensors: the
device pool and the host pool are both host memory here, as in the engine suite's CPU runs):

1. a backup (device -> host, every layer of the pool in one call, as
   ``backup_from_device_all_layer`` with the ``direct`` backend: one ``index_select`` + ``index_copy_``
   per layer's K and V) alone and with :meth:`HostTier.backup`; a load (one call per layer, as
   ``load_to_device_per_layer``) alone and with :meth:`HostTier.load_started` (before layer 0) and
   :meth:`HostTier.load_arrived` (after the last layer), and the tables' moves alone: microseconds
   per transferred token, for
   transfers of 64 and 1,024 tokens, at the engine suite's SWA pool (3 layers, 2 KV heads of 16,
   float32) and at a 7B-like pool (32 layers, 8 KV heads of 128, bf16);
2. host memory per host slot: the tables (stamps 8 bytes, folds 16) against the KV bytes the host
   pool holds per slot at those shapes.

Run: ``python benchmarks/bench_hicache_tier.py [--rounds 7]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, interleaved, machine_line, one_thread, print_table, ratios, timed  # noqa: E402

from otel_swa.device.gate import SamplingGate  # noqa: E402
from otel_swa.device.host_tier import HostTier  # noqa: E402
from otel_swa.device.provenance import KvProvenance  # noqa: E402

#: name -> (layers, KV heads, head dim, dtype)
SHAPES = {"engine suite SWA pool": (3, 2, 16, torch.float32), "7B-like pool": (32, 8, 128, torch.bfloat16)}
DEVICE_SLOTS = 4096
HOST_SLOTS = 16384


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """HiCache's ``direct`` copy of one layer's K or V rows."""
    dst.index_copy_(0, dst_rows, src.index_select(0, src_rows))


def pools(shape) -> tuple:
    layers, heads, dim, dtype = shape
    device = [(torch.randn(DEVICE_SLOTS, heads, dim).to(dtype), torch.randn(DEVICE_SLOTS, heads, dim).to(dtype))
              for _ in range(layers)]
    host = [(torch.zeros(HOST_SLOTS, heads, dim, dtype=dtype), torch.zeros(HOST_SLOTS, heads, dim, dtype=dtype))
            for _ in range(layers)]
    return device, host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    one_thread()
    print(machine_line())
    print()
    provenance = KvProvenance("cpu", SamplingGate("cpu"), full_slots=DEVICE_SLOTS, swa_slots=DEVICE_SLOTS)
    tier = HostTier(provenance, {"full": HOST_SLOTS, "swa": HOST_SLOTS})
    rows = []
    memory = []
    for name, shape in SHAPES.items():
        device, host = pools(shape)
        layers, heads, dim, dtype = shape
        kv_bytes = 2 * layers * heads * dim * torch.tensor([], dtype=dtype).element_size()
        memory.append((name, str(kv_bytes), str(tier.bytes_per_host_slot["swa"]),
                       f"{100 * tier.bytes_per_host_slot['swa'] / kv_bytes:.2f} %"))
        for tokens in (64, 1024):
            generator = torch.Generator().manual_seed(tokens)
            dev = torch.randperm(DEVICE_SLOTS, generator=generator)[:tokens]
            hst = torch.randperm(HOST_SLOTS, generator=generator)[:tokens]

            def transfer(kind: str, copy: bool, follow: bool) -> None:
                """A backup (``kind`` "backup": device -> host) or a load, its copy and/or its moves."""
                if follow and kind == "load":
                    tier.load_started("swa", hst, dev)
                for pair in zip(device, host) if copy else ():
                    (src, dst), (src_rows, dst_rows) = (pair, (dev, hst)) if kind == "backup" else (pair[::-1], (hst, dev))
                    for a, b in zip(src, dst):
                        copy_rows(a, b, src_rows, dst_rows)
                if follow:
                    (tier.backup if kind == "backup" else tier.load_arrived)("swa", hst, dev)

            number = max(1, 2048 // tokens)
            got = interleaved({
                f"{kind} {variant}": timed(lambda kind=kind, on=on: transfer(kind, *on), number)
                for kind in ("backup", "load")
                for variant, on in (("off", (True, False)), ("on", (True, True)), ("moves", (False, True)))
            }, args.rounds)
            per_token = 1e6 / tokens
            for kind in ("backup", "load"):
                off, on = got[f"{kind} off"], got[f"{kind} on"]
                rows.append((name, str(tokens), kind, fmt(off, per_token, 3), fmt(on, per_token, 3),
                             fmt(got[f"{kind} moves"], per_token, 3), fmt(ratios(on, off), 1, 3)))
    print_table("1. per transferred token, microseconds (provenance off = the copy alone; on = the copy and the "
                "host tables' moves)",
                ("pool shape", "tokens", "transfer", "off", "on", "the moves alone", "on / off"), rows)
    print_table("2. host memory per host slot, bytes (one pool)",
                ("pool shape", "KV bytes per slot", "host tables", "tables / KV"), memory)


if __name__ == "__main__":
    main()
