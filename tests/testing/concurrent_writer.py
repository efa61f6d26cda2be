"""One rank of an engine writing otel-swa's lines to a shared log in parts, for the interleaving trials.

A stand-in for a logging handler whose stream is unbuffered and writes a line in several system
calls (the log prefix, the message, the line end), as several engine processes (tensor or data
parallel ranks) do when they share one log file: another process's write can land between the
parts. It writes, through its own ``O_APPEND`` descriptor, the lines otel-swa's line sink writes
(``otel_swa.logline``): the run start marker, then each record's line and its audit line, after an
SGLang-style prefix ``[time TPn]``. Standard library only, so that the processes start in a few
milliseconds and write at once.

Usage: ``python concurrent_writer.py PATH RANK RECORDS PARTS SEED YIELD [broken]``: it waits
until its standard input closes (the test closes every writer's at once, when all are up: the ranks
write at once) and, for the
fraction ``YIELD`` of its lines, yields the processor between their parts (a handler formatting
between its writes, a process descheduled), so that the parts of other ranks' lines land in
between. Where they land depends on the machine and its load: :func:`interleaved` makes the same
kind of log from the same writes with a seeded scheduler instead, the same on every machine.
A healthy rank's samples are idle 70 % of the time (no divergence, no out-of-window token; its
first sample among them), its SWA pool reading less than its FULL pool at a rate of its own; a
broken rank (the SWA path not running) is idle throughout and reads as much in both pools.
"""

import json
import os
import random
import sys

RECORD = "kv_canary_swa_divergence="
AUDIT = "otel_swa_audit="
START = "otel_swa_run_start="
TAG = "otel_swa[verify=attention] "


def compact(value):
    return json.dumps(value, separators=(",", ":"))


def rank_lines(rank, records, parts, seed, yield_share, broken, pid=None):
    """The writes of one rank, line by line: ``[(chunks, pause), ...]``, where ``chunks`` are the
    texts of one line's writes (1, 2 or 3 of them: the prefix, the message, the line end) and
    ``pause`` whether the writer yields the processor between them. The same for the same
    arguments (``pid``, in the run start marker, default ``1000 + rank``)."""
    rng = random.Random(seed * 1000 + rank)  # the samples
    pauses = random.Random(seed * 1000 + rank + 500)  # the writes
    prefix = f"[2026-01-01 00:00:00 TP{rank}] "
    out = []

    def write(message):
        if parts == 1:
            chunks = [prefix + message + "\n"]
        elif parts == 2:
            chunks = [prefix, message + "\n"]
        else:
            chunks = [prefix, message, "\n"]
        out.append((chunks, parts > 1 and pauses.random() < yield_share))

    write(TAG + START + compact({"pid": 1000 + rank if pid is None else pid}))
    full = swa = 0
    rate = rng.randint(50, 400)
    for i in range(1, records + 1):
        ct = 20 * i
        step = rate * 20 + rng.randint(0, 2000)
        full += step
        swa += step if broken else step // 3
        idle = broken or i == 1 or rng.random() < 0.7
        divergence, out_of_window = (0, 0) if idle else (rng.randint(1, 50), rng.randint(1, 900))
        write(TAG + RECORD + compact({"forward_ct": ct, "verify_full": full, "verify_swa": swa,
                                      "swa_full_idx_divergence": divergence,
                                      "swa_out_of_window_tokens": out_of_window}))
        write(TAG + AUDIT + compact({"forward_ct": ct, "swa_leaked_slots": 0, "swa_stale_tokens": 0,
                                     "swa_shared_slots": 0, "swa_pages_in_use": 10, "swa_pages_referenced": 10}))
    return out


def interleaved(writers, seed, switch_in_line=0.03, switch_in_pause=0.6, switch_at_line_end=0.5):
    """One log written by ``writers`` (each a :func:`rank_lines` list) at once, interleaved by a
    seeded scheduler instead of the operating system: after each write, another writer (one with
    writes left, at random) goes on with probability ``switch_in_pause`` inside a line whose writer
    yields, ``switch_in_line`` inside any other line, ``switch_at_line_end`` after a line end. The
    same text for the same arguments, on any machine under any load."""
    pick = random.Random(seed)
    queues = [[(chunk, index + 1 < len(chunks), pause) for chunks, pause in lines
               for index, chunk in enumerate(chunks)] for lines in writers]
    heads = [0] * len(queues)
    out = []
    current = 0
    while True:
        left = [w for w, queue in enumerate(queues) if heads[w] < len(queue)]
        if not left:
            return "".join(out)
        if current not in left:
            current = pick.choice(left)
        chunk, inside, pause = queues[current][heads[current]]
        heads[current] += 1
        out.append(chunk)
        share = (switch_in_pause if pause else switch_in_line) if inside else switch_at_line_end
        if pick.random() < share:
            current = pick.choice(left)


def main(path, rank, records, parts, seed, yield_share, broken):
    lines = rank_lines(rank, records, parts, seed, yield_share, broken, pid=os.getpid())
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdin.read()  # the start: every writer is up
    for chunks, pause in lines:
        for chunk in chunks:
            os.write(fd, chunk.encode())
            if pause:
                os.sched_yield()
    os.close(fd)


if __name__ == "__main__":
    path, rank, records, parts, seed = sys.argv[1], *map(int, sys.argv[2:6])
    main(path, rank, records, parts, seed, float(sys.argv[6]), broken=len(sys.argv) > 7 and sys.argv[7] == "broken")
