"""The reporter's side of the checks an engine runs inside its forward: the sampling decision they
take from the device, and the calls that switch them on (the read check, provenance with its
stamps, checksums and write check, and a write check the engine runs itself).

Checks inside the forward take the sampling decision from the device: :meth:`InForwardChecks.before_forward`
sets :attr:`InForwardChecks.sampling_flag` before each forward, so that a forward replayed from a
CUDA graph holding the checks is checked at its sampled steps (:mod:`otel_swa.device.gate`). Each
check switched on becomes the device part of its check (:mod:`otel_swa.checks`), which the
reporter's samples stage (:mod:`otel_swa.sampling`). :class:`InForwardChecks` is a base of
:class:`~otel_swa.reporter.SwaDivergenceReporter`, whose state (``_parts``, ``_gate``,
``_other_gates``, ``_round``, ``_forward_ct``, ``_closed``, ``device``, ``interval``) it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from otel_swa.device.gate import SamplingGate
from otel_swa.record import MICRO_BATCH_MAX

from otel_swa.checks.write import AttachedWriteCheck

if TYPE_CHECKING:
    from otel_swa.device.provenance import KvProvenance
    from otel_swa.device.read_check import ReadCheck
    from otel_swa.device.write_check import WriteCheck

__all__ = ["InForwardChecks"]


class InForwardChecks:
    """The engine-facing calls of the in-forward checks (a base of the reporter)."""

    # ------------------------------------------------------------------ the sampling decision on the device
    def before_forward(self, *, micro_batch: "int | None" = None) -> None:
        """Say before each forward step whether it is a sampling step: sets :attr:`sampling_flag`
        (one tiny device write, only when the decision changes) for the checks a CUDA graph holds,
        and the host's decision for eager ones. Call it outside capture, before the forward runs or
        is replayed (SGLang: at the start of the ``ModelRunner.forward`` wrapper); inside a capture
        it does nothing. Without it eager checks still run at the right steps (the host decision is
        also kept by :meth:`step`), but a replayed graph's checks see a stale flag.

        Args:
            micro_batch: the micro-batch the forward runs (``micro_batches="every"``), or ``None``.

        Raises:
            ValueError: ``micro_batch`` is not ``None`` nor an int in ``0 .. MICRO_BATCH_MAX``.
        """
        check_micro_batch(micro_batch)
        if self._closed or (self._cuda and torch.cuda.is_current_stream_capturing()):
            return
        due = self._due_next(micro_batch)
        self._gate.set(due)
        for gate in self._other_gates:
            if not gate.capturing():
                gate.set(due)

    def _set_host_due(self, due: bool) -> None:
        """The host's decision for the next forward, on every gate (no device work)."""
        self._gate.due = due
        for gate in self._other_gates:
            gate.due = due

    def _due_next(self, micro_batch: "int | None") -> bool:
        """Whether the next :meth:`step` samples (its ``forward_ct`` and, in a round of
        ``micro_batches="every"``, ``micro_batch``); no state changes."""
        if self._closed:
            return False
        if (self._forward_ct + 1) % self.interval == 0:
            return True
        return self._round is not None and micro_batch is not None and micro_batch not in self._round

    @property
    def sampling_flag(self) -> torch.Tensor:
        """``bool`` 0-dim on the reporter's device, True while the forward now running is a sampling
        step (set by :meth:`before_forward`); the same tensor for the reporter's life, so a CUDA graph
        may read it."""
        return self._gate.flag

    @property
    def gate(self) -> SamplingGate:
        """The :class:`~otel_swa.device.gate.SamplingGate` the in-forward checks share."""
        return self._gate

    def checks_wanted(self) -> bool:
        """Whether an in-forward check called now should run: the forward is a sampling step, or a
        CUDA graph is being captured (the check is then recorded, its effect at each replay decided
        by :attr:`sampling_flag`). Host work only."""
        return not self._closed and self._gate.wanted()

    def enable_provenance(self, *, full_slots: int, swa_slots: "int | None" = None, **options: Any) -> "KvProvenance":
        """Switch provenance on (:mod:`otel_swa.device.provenance`: stamps and checksums written at
        every forward step, verified with each sample, and the write check) and return it; the
        engine then calls its :meth:`~otel_swa.device.provenance.KvProvenance.stamp` once per forward
        and :meth:`~otel_swa.device.provenance.KvProvenance.after_layer` after each attention layer.
        Idempotent: the same object is returned after the first call (its arguments then ignored).

        Args:
            full_slots, swa_slots: slots of the FULL and SWA pools (their K/V buffers' first
                dimension; ``swa_slots=None``: no SWA pool). The tables take 24 bytes per slot
                (8 of stamps, 16 of checksums), on the reporter's device.
            options: :class:`~otel_swa.device.provenance.KvProvenance`'s (``checksum``,
                ``checksum_bytes``, ``checksum_layers``, ``checksum_order``, ``budget``, ``write_check``,
                ``write_check_tokens``, ``write_check_layers``).

        Raises:
            ValueError: an argument out of range.
            TypeError: an unknown option.
        """
        provenance = self._parts.get("provenance")
        if provenance is None:
            from otel_swa.device.provenance import KvProvenance

            provenance = self._parts["provenance"] = KvProvenance(
                self.device, self._gate, full_slots=full_slots, swa_slots=swa_slots, **options)
            if "write" not in self._parts and provenance.write_check is not None:
                self._parts["write"] = provenance.write_check
        return provenance

    def attach_provenance(self, provenance: "KvProvenance") -> None:
        """Take the verification of a provenance the engine made itself (e.g.
        :class:`~otel_swa.device.paged_provenance.PagedProvenance`, made where the model runner is
        set up before the scheduler exists) into every sample, as :meth:`enable_provenance`'s: its
        stamps and checksums are written by the engine, the samples stage its verification. Its
        gate, when it is not this reporter's own, is set by :meth:`before_forward` too.

        Raises:
            TypeError: ``provenance`` is not a ``KvProvenance``.
        """
        from otel_swa.device.provenance import KvProvenance

        if not isinstance(provenance, KvProvenance):
            raise TypeError(f"provenance must be a KvProvenance, got {type(provenance).__name__}")
        self._parts["provenance"] = provenance
        self._follow(provenance.gate)

    @property
    def provenance(self) -> "KvProvenance | None":
        """Provenance, or ``None`` while it is off."""
        return self._parts.get("provenance")

    def attach_write_check(self, check: WriteCheck, *, batch: "Callable[[], Any] | None" = None,
                           layers: "Mapping[int, tuple[str | None, int | None, bool]] | None" = None) -> None:
        """Take the cells of a write check the engine runs itself
        (:class:`~otel_swa.device.write_check.WriteCheck`, made before this reporter, e.g. where
        the model runner is set up before the scheduler exists, on the KV cache's device, which
        may differ from this reporter's) into every sample: the write check's fields
        (:mod:`otel_swa.checks.write`) and its first mismatch as an offender. Used instead of provenance's write
        check when both exist.

        :meth:`before_forward` then also sets ``check.gate`` (when it is not this reporter's own
        gate): the engine calls :meth:`before_forward` before each forward and the check's
        ``check_layer`` after each layer's store, as with provenance. The sample copies the
        check's cells into the staged sample (a copy from the check's device: where that is a GPU
        and this reporter's device the CPU, the copy waits for the work queued on the current
        stream, once per sample).

        Args:
            check: the write check.
            batch: returns, when a sample is taken, the request ids of the forward step whose
                checks the cells hold (a sequence of strings, index = the offender's ``entry``),
                or ``None`` when unknown; an exception is logged and taken as ``None``.
            layers: ``layer_id -> (layer name, KV cache group, rows)`` for the offender (name and
                group ``None`` when unknown); ``rows``: the check's ``entry`` is the token's batch
                row (the layer's store gave ``extend_start_loc``), so ``batch()[entry]`` is its
                request; else the entry is a token index and neither row nor request is named. A
                layer not in the mapping: no name, no group, no row.

        Raises:
            TypeError: ``check`` is not a ``WriteCheck``.
        """
        from otel_swa.device.write_check import WriteCheck

        self._attach("write", AttachedWriteCheck, WriteCheck, check, batch, layers)

    def _attach(self, name: str, attached: type, expected: type, check: Any, batch: Any, layers: Any) -> None:
        """Hold ``check`` (an ``expected``) as part ``name``, wrapped in ``attached`` with what its
        offender names, and set its gate from :meth:`before_forward` too."""
        if not isinstance(check, expected):
            raise TypeError(f"check must be a {expected.__name__}, got {type(check).__name__}")
        self._parts[name] = attached(check, batch, dict(layers) if layers is not None else None)
        self._follow(check.gate)

    def _follow(self, gate: SamplingGate) -> None:
        """Set ``gate`` from :meth:`before_forward` too (a check's own gate, on another device)."""
        if gate is not self._gate and all(g is not gate for g in self._other_gates):
            self._other_gates.append(gate)
            gate.due = self._gate.due

    @property
    def write_check(self) -> "WriteCheck | None":
        """The write check whose cells the samples take: the attached one, else provenance's."""
        part = self._parts.get("write")
        return part.check if isinstance(part, AttachedWriteCheck) else part

    # ------------------------------------------------------------------ the read check
    def enable_read_check(self, *, max_queries: int = 8, layers: str = "rotate") -> "ReadCheck":
        """Switch the read check on (:mod:`otel_swa.device.read_check`) and return it: at each
        sampled forward step the engine's sliding-window layers call
        :meth:`~otel_swa.device.read_check.ReadCheck.check_layer` (while :meth:`read_check_due`
        holds) and the sample carries the results (:mod:`otel_swa.checks.read`'s fields, and the
        first disagreeing query as an offender). Idempotent: the
        same object is returned after the first call.

        Raises:
            ValueError: ``max_queries`` or ``layers`` out of range (see ``ReadCheck``).
        """
        check = self._parts.get("read")
        if check is None:
            from otel_swa.device.read_check import ReadCheck

            check = self._parts["read"] = ReadCheck(self.device, max_queries=max_queries, layers=layers,
                                                    gate=self._gate)
        return getattr(check, "check", check)  # an attached one: its device check

    def attach_read_check(self, check: "ReadCheck", *, batch: "Callable[[], Any] | None" = None,
                          layers: "Mapping[int, tuple[str | None, int | None, bool]] | None" = None) -> None:
        """Take the cells of a read check the engine's model runner runs itself (vLLM's: made
        before this reporter, on the KV cache's device, its queries the runner's batch rows) into
        every sample, as :meth:`attach_write_check` does for the write check: its fields
        (:mod:`otel_swa.checks.read`) and its first disagreeing query as an offender, named by
        ``batch()`` (the request ids of the checked step, in the runner's batch order) and
        ``layers`` (``layer_id -> (layer name, KV cache group, rows)``). :meth:`before_forward`
        then also sets the check's gate, as for an attached write check (the two may share one):
        the engine calls ``check_layer`` after each sliding-window layer while ``gate.wanted()``.

        Raises:
            TypeError: ``check`` is not a ``ReadCheck``.
        """
        from otel_swa.checks.read import AttachedReadCheck
        from otel_swa.device.read_check import ReadCheck

        self._attach("read", AttachedReadCheck, ReadCheck, check, batch, layers)

    @property
    def read_check(self) -> "ReadCheck | None":
        """The read check, or ``None`` while it is off (the attached one's device check)."""
        part = self._parts.get("read")
        return getattr(part, "check", part)

    def read_check_due(self) -> bool:
        """Whether the forward step now running (the next :meth:`step`) is a sampling step whose
        sliding-window layers should be checked: the read check is on, the reporter open, and the
        step's ``forward_ct`` a multiple of ``interval``. Host work only (an increment's worth)."""
        return ("read" in self._parts and not self._closed
                and (self._forward_ct + 1) % self.interval == 0)


def check_micro_batch(micro_batch: Any) -> None:
    """Raise ``ValueError`` unless ``micro_batch`` is ``None`` or an int in ``0 .. MICRO_BATCH_MAX``."""
    if micro_batch is not None and (type(micro_batch) is not int or not 0 <= micro_batch <= MICRO_BATCH_MAX):
        raise ValueError(f"micro_batch must be None or an int from 0 to {MICRO_BATCH_MAX}, got {micro_batch!r}")
