"""Provenance stamps: which token's KV a slot holds, as one ``int64`` per slot.

torch only (and numpy for the host's expected stamps: the same arithmetic, bit for bit).

Layout of a stamp (an ``int64``; 0 means "never stamped")::

    bit 63      1: stamped (every stamp is negative; an unstamped slot is 0)
    bit 62      1: chain unknown (the request's previous position was unstamped: see below)
    bits 42-61  chain: a 20-bit sum over the request's prefix, positions 0 .. p
    bits 22-41  token id mod 2**20
    bits  0-21  position mod 2**22

The chain. For a request with tokens ``t_0 .. t_p``::

    chain_p = (f(t_0, 0) + f(t_1, 1) + ... + f(t_p, p)) mod 2**20

with ``f`` an integer mix of the token and the position (:func:`mix`: a linear form of the two,
folded by a xor-shift and kept to 31 bits, times an odd 31-bit constant, folded by a 31-bit
xor-shift, bits 11-30 out: ten elementwise operations). Because the chain is a sum, the expected stamps of a whole request are one
``cumsum`` (the host computes them in parallel at a sample, :func:`expected_stamps`), and the stamp
of a new token is the previous position's chain plus one ``f`` (a decode step reads one stamp per
request; an extend step one per request and a ``cumsum`` within the step). ``f`` is not linear, so
two prefixes with the same tokens in another order, or with token sums that agree, still differ:
the same token at the same position after another prefix gets another chain, as SGLang's KV canary
asks of its splitmix64 chain (``sglang/srt/kv_canary``), with 20 bits instead of 64.

Why this arithmetic: every intermediate value stays below 2**63 (``f`` works on values below
2**42, then 2**31 x 2**31; the ``cumsum`` of a request adds at most 2**22 values below 2**20), so
torch's ``int64`` operations never overflow and the host's numpy gives the same bits; the whole
stamp is built with three fused ``add(alpha=2**k)`` operations. Measured
(``benchmarks/bench_provenance.py`` table 6, and 2**20 trials each while choosing it): random
64-token prefixes (vocabulary 512) share a chain as often as uniform 20-bit values would (133 pairs
of 134 million, 128 expected), and a prefix never matched itself after two of its tokens were
swapped or after a change that kept the token sum (0 of 2**20 each, about 1 expected of uniform
chains). Shorter mixes fail that: without the first xor-shift a sum-keeping change collided 197
times in 2**20, a swap 40 times (their structure survives the multiplication).

What a comparison tells (a slot whose stamp is not the one expected from the request's own tokens
holds another token's KV: "foreign"):

* a foreign token whose token id differs (mod 2**20: every vocabulary up to 1,048,576 ids, i.e. all
  of today's models, exactly) or whose position differs (mod 2**22 = 4,194,304) is always seen;
* a foreign token with the same token id at the same position but another prefix (a stale prefix
  or radix-cache entry re-used, the same prompt token in another request) is missed only when the
  two chains agree: probability 2**-20 (about 1e-6) per slot compared, for prefixes ``f`` spreads
  evenly;
* the same token at the same position after the same prefix is not foreign: a prefix cache shares
  exactly such KV.

Chain unknown. A stamp is written from the stamp of the request's previous position in the FULL
pool. When that one was never stamped (KV written before otel-swa was attached, or moved into its
slot by something other than a forward step: a HiCache load-back, a disaggregated transfer, unless
the engine moves the stamps too, :meth:`otel_swa.device.provenance.KvProvenance.move_slots`), the
chain cannot be known: the new stamp then carries bit 62 and is compared on its token and position
only (and every later position of that request inherits the bit).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

__all__ = [
    "POSITION_BITS",
    "TOKEN_BITS",
    "CHAIN_BITS",
    "TOKEN_POSITION_MASK",
    "TOKEN_MASK",
    "POSITION_MASK",
    "CHAIN_MASK",
    "mix",
    "mix_numpy",
    "write_stamps",
    "expected_stamps",
    "stamp_values",
    "ChainCache",
    "decode_stamp",
    "chain_known",
]

POSITION_BITS = 22
TOKEN_BITS = 20
CHAIN_BITS = 20
_TOKEN_SHIFT = POSITION_BITS
_CHAIN_SHIFT = POSITION_BITS + TOKEN_BITS  # 42
_CODE_SHIFT = _CHAIN_SHIFT + CHAIN_BITS  # 62: bits 62-63 read as one signed code
POSITION_MASK = (1 << POSITION_BITS) - 1
TOKEN_MASK = (1 << TOKEN_BITS) - 1
CHAIN_MASK = (1 << CHAIN_BITS) - 1
#: The bits a stamp with an unknown chain is compared on: token id and position.
TOKEN_POSITION_MASK = (1 << _CHAIN_SHIFT) - 1
# ``stamp >> 62`` (an arithmetic shift): -2 for a stamp with a known chain, -1 for one with an
# unknown chain, 0 for "never stamped"
_KNOWN, _UNKNOWN = -2, -1
#: The stamp before position 0 of every request: a known chain of 0.
_ANCHOR = _KNOWN << _CODE_SHIFT

# the mix's constants (odd, below the bounds that keep every product under 2**63)
_A, _B, _C = 0x9E37F, 0x7F4A7, 0x5BD1E995


def mix(token: torch.Tensor, position: torch.Tensor, reduced: bool = True) -> torch.Tensor:
    """``f(token, position)``: ``int64`` in ``0 .. 2**20 - 1``, elementwise (module docstring).

    Args:
        token: ``int64``, values in ``0 .. 2**20 - 1`` (ids already reduced).
        position: ``int64``, values in ``0 .. 2**22 - 1`` (positions already reduced).
        reduced: ``False`` leaves out the last ``& (2**20 - 1)``: a value below 2**51 equal to ``f``
            mod 2**20, for a caller that reduces a sum of it mod 2**20 anyway.

    Ten elementwise device operations (nine unreduced); no intermediate reaches 2**63.
    """
    x = torch.add(token * _A, position, alpha=_B)  # < 2**42
    x ^= x >> 17
    x &= 0x7FFFFFFF
    x *= _C  # < 2**62
    x ^= x >> 31
    x >>= 11
    return x.bitwise_and_(CHAIN_MASK) if reduced else x


def mix_numpy(token: np.ndarray, position: np.ndarray) -> np.ndarray:
    """:func:`mix` on the host: the same bits from ``int64`` numpy arrays."""
    x = token.astype(np.int64) * _A + position.astype(np.int64) * _B
    x ^= x >> 17
    x &= 0x7FFFFFFF
    x *= _C
    x ^= x >> 31
    x >>= 11
    return x & CHAIN_MASK


def write_stamps(
    stamps: torch.Tensor,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    extend_start_loc: "torch.Tensor | None" = None,
    extra: "tuple[tuple[torch.Tensor, torch.Tensor], ...]" = (),
) -> torch.Tensor:
    """Stamp the slots a forward step writes; return the stamps (``int64 [T]``).

    Fixed shapes, no host read, no allocation that depends on values: safe inside CUDA graph
    capture (every replay stamps the replayed step's tokens).

    Args:
        stamps: the FULL pool's stamps, ``int64 [num_full_slots]``: read for each request's previous
            position, then written at ``slots``.
        token_ids: ``int [T]``, the step's input token ids (SGLang's ``forward_batch.input_ids``).
        positions: ``int [T]``, their positions.
        slots: ``int [T]``, the FULL slot each token's KV is written to (``out_cache_loc``).
        req_pool_indices: ``int [B]``, each request's ``req_to_token`` row.
        req_to_token: ``int [rows, max_context_len]``, FULL slot per position (any strides).
        extend_start_loc: ``int [B]``, the first token of each request in the step (sorted; an
            extend or mixed batch, SGLang's ``forward_batch.extend_start_loc``), or ``None`` when
            token ``i`` is request ``i``'s only new token (a decode batch, ``T == B``).
        extra: further ``(table, table_slots)`` pairs to write the same stamps into (the SWA pool's
            stamps at ``full_to_swa_index_mapping[slots]``).

    Padding tokens (slot 0, row 0: SGLang's padded graph batches) write slot 0, which never holds a
    live token.
    """
    tok = token_ids.long() & TOKEN_MASK
    pos = positions.long()
    posm = pos & POSITION_MASK
    # a decode step adds one f to a chain reduced mod 2**20 below: f's own reduction is not needed
    # (an extend step's cumsum needs it, to stay below 2**63)
    f = mix(tok, posm, reduced=extend_start_loc is not None)
    width = req_to_token.shape[1]
    if extend_start_loc is None:
        rows, first_pos = req_pool_indices, pos
        sums = f
    else:
        starts = extend_start_loc.long()
        seg = torch.searchsorted(starts, torch.arange(tok.shape[0], device=tok.device), right=True)
        seg = seg.sub_(1).clamp_(0, max(starts.shape[0] - 1, 0))
        start = starts.index_select(0, seg).clamp_(0, max(tok.shape[0] - 1, 0))
        running = torch.cumsum(f, 0)
        # the sum of f within the segment, its first token included: running - running_before_start
        sums = running - (running - f).index_select(0, start)
        rows, first_pos = req_pool_indices.index_select(0, seg), pos.index_select(0, start)
    prev_full = req_to_token[rows.long(), (first_pos - 1).clamp_(0, width - 1)]  # int32 or int64: both index
    prev = stamps.index_select(0, prev_full.clamp_(0, stamps.shape[0] - 1))
    prev.masked_fill_(first_pos.eq(0), _ANCHOR)
    chain = (prev >> _CHAIN_SHIFT).add_(sums).bitwise_and_(CHAIN_MASK)
    code = (prev >> _CODE_SHIFT).clamp_(max=_UNKNOWN)  # -2 known, -1 unknown (or from an unstamped one)
    stamp = torch.add(posm, tok, alpha=1 << _TOKEN_SHIFT)
    stamp.add_(chain, alpha=1 << _CHAIN_SHIFT).add_(code, alpha=1 << _CODE_SHIFT)
    loc = slots.long()
    stamps.index_copy_(0, loc, stamp)
    for table, table_slots in extra:
        table.index_copy_(0, table_slots, stamp)
    return stamp


def expected_stamps(tokens: np.ndarray, start: int, chain_before: int = 0) -> "tuple[np.ndarray, int]":
    """The stamps a request's own tokens give positions ``start .. start + len(tokens) - 1``
    (host, numpy), and the chain at the last of them.

    Args:
        tokens: ``int64 [n]``, the request's token ids at those positions.
        start: the position of ``tokens[0]``.
        chain_before: the chain at position ``start - 1`` (0 for ``start == 0``).

    Returns:
        ``(stamps int64 [n], chain)``.
    """
    n = tokens.shape[0]
    tok = tokens.astype(np.int64) & TOKEN_MASK
    pos = (np.arange(start, start + n, dtype=np.int64)) & POSITION_MASK
    chain = (np.cumsum(mix_numpy(tok, pos)) + chain_before) & CHAIN_MASK
    return stamp_values(tok, pos, chain), int(chain[-1]) if n else chain_before


def stamp_values(tokens: np.ndarray, positions: np.ndarray, chains: np.ndarray) -> np.ndarray:
    """Host stamps (known chain) of ``int64`` token ids, positions and chains (already below 2**20)."""
    return ((positions & POSITION_MASK) + ((tokens & TOKEN_MASK) << _TOKEN_SHIFT) + (chains << _CHAIN_SHIFT)
            + (_KNOWN << _CODE_SHIFT))


def chain_known(stamp: int) -> bool:
    """Whether ``stamp`` (an int) is stamped with a known chain."""
    return (stamp >> _CODE_SHIFT) == _KNOWN


def decode_stamp(stamp: int) -> "dict[str, int] | None":
    """A stamp's ``token`` (mod 2**20), ``position`` (mod 2**22), ``chain`` and ``chain_known``
    (0/1), or ``None`` for 0 (never stamped)."""
    if stamp == 0:
        return None
    return {
        "token": (stamp >> _TOKEN_SHIFT) & TOKEN_MASK,
        "position": stamp & POSITION_MASK,
        "chain": (stamp >> _CHAIN_SHIFT) & CHAIN_MASK,
        "chain_known": int(chain_known(stamp)),
    }


class ChainCache:
    """Each request's chain every ``every`` positions, on the host (:meth:`expected`), so that a
    sample converts only the token ids of the positions it verifies (and those since the last
    checkpoint). Entries unused for ``keep`` samples are dropped (:meth:`end_sample`).

    Args:
        every: positions between two kept chains (int >= 1).
        keep: samples an unused entry is kept (int >= 1).
    """

    def __init__(self, every: int = 1024, keep: int = 64) -> None:
        self.every = every
        self.keep = keep
        self._chains: dict[Any, list[int]] = {}  # key -> [chain before position k * every for k = 0, 1, ...]
        self._used: dict[Any, int] = {}
        self._sample = 0

    def expected(self, key: Any, token_ids: Any, lo: int, hi: int) -> np.ndarray:
        """The expected stamps of positions ``lo .. hi - 1`` (``int64 [hi - lo]``) of the request
        ``key`` (``None``: not cached) whose token ids are ``token_ids`` (sliced ``[a:b]``)."""
        return self.expected_many([(key, token_ids, lo, hi)])[0]

    def expected_many(self, ranges: "Sequence[tuple[Any, Any, int, int]]") -> "list[np.ndarray]":
        """:meth:`expected` of several ``(key, token_ids, lo, hi)`` in one numpy pass (the mix and
        the chains of every range together): one array per range."""
        every = self.every
        begins, befores, parts, cached = [], [], [], []
        for key, token_ids, lo, hi in ranges:
            chains = self._chains.get(key) if key is not None else None
            if chains is None:
                chains = [0]
                if key is not None:
                    self._chains[key] = chains
            if key is not None:
                self._used[key] = self._sample
            k = min(lo // every, len(chains) - 1)
            begins.append(k * every)
            befores.append(chains[k])
            parts.append(np.asarray(token_ids[k * every:hi], dtype=np.int64).reshape(-1))
            cached.append(chains)
        if not parts:
            return []
        sizes = np.fromiter((len(part) for part in parts), dtype=np.int64, count=len(parts))
        starts = np.cumsum(sizes) - sizes
        tokens = np.concatenate(parts)
        # each range's positions, and its chain: the running sum less the sum before the range
        shift = np.repeat(np.asarray(begins, dtype=np.int64) - starts, sizes)
        positions = np.arange(len(tokens), dtype=np.int64) + shift
        running = np.cumsum(mix_numpy(tokens & TOKEN_MASK, positions & POSITION_MASK))
        before = np.where(starts > 0, running[np.maximum(starts - 1, 0)], 0) - np.asarray(befores, dtype=np.int64)
        chain = (running - np.repeat(before, sizes)) & CHAIN_MASK
        stamps = stamp_values(tokens, positions, chain)
        out = []
        for (key, _, lo, hi), chains, begin, start in zip(ranges, cached, begins, starts.tolist()):
            # keep the chain before each multiple of `every` passed (the chain of its previous position)
            while len(chains) * every <= hi:
                chains.append(int(chain[start + len(chains) * every - 1 - begin]))
            out.append(stamps[start + lo - begin:start + hi - begin])
        return out

    def end_sample(self) -> None:
        """Count a sample; drop the entries unused for ``keep`` samples (checked every ``keep``)."""
        self._sample += 1
        if self._sample % self.keep == 0:
            stale = [key for key, used in self._used.items() if used < self._sample - self.keep]
            for key in stale:
                del self._used[key]
                self._chains.pop(key, None)

    def __len__(self) -> int:
        return len(self._chains)
