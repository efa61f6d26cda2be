"""The plain-Python recount the reporter's counts are checked against: SGLang's definitions applied
one live token at a time (the rule in ``docs/``: a token whose FULL slot maps to SWA slot 0 is out of
window; one that maps to another slot than its own FULL slot diverges)."""

from __future__ import annotations

from typing import Sequence


def recount(req_to_token: Sequence[Sequence[int]], mapping: Sequence[int], rows: Sequence[int],
            lens: Sequence[int]) -> tuple[int, int]:
    """``(divergence, out_of_window)`` over the first ``lens[i]`` positions of row ``rows[i]`` of
    ``req_to_token`` (host lists of FULL slots), ``mapping`` the FULL-to-SWA index list."""
    divergence = out_of_window = 0
    for row, length in zip(rows, lens):
        for pos in range(length):
            full = req_to_token[row][pos]
            swa = mapping[full]
            if swa == 0:
                out_of_window += 1
            elif swa != full:
                divergence += 1
    return divergence, out_of_window
