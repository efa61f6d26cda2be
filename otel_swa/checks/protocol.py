"""The protocol of a check: what every check declares and does, for the loops that run them.

A check is one object (a :class:`Check` subclass instance, one module of :mod:`otel_swa.checks`), the
way an OpenTelemetry ``SpanProcessor`` is one class the provider loops over. It declares:

* its **record fields** (:class:`CheckField`: name, unit, meaning, and its role for the CI verdict:
  ``fault`` — judged, must stay 0, its first offender written on a fault line; ``info`` — shown
  with its peak, never judged; ``count`` — how much was checked), all on one **line kind**
  (:attr:`Check.line`: the ``otel_swa_audit=`` or the ``otel_swa_provenance=`` line);
* its **metric rows** (:class:`MetricRow`), which the telemetry turns into instruments;
* its **device part**: how many ``int64`` cells it takes in the staged sample's row
  (:attr:`Check.width`), what it writes there at a sampled step (:meth:`Check.stage`, on the
  device, in stream order, capture-safe where the engine runs it in a graph) and what host values
  it keeps beside them (:meth:`Check.keep`);
* its **host part**: the record fields it reads from its cells once they reached the host and its
  first offenders (:meth:`Check.read`), the replay summary's row
  (:meth:`Check.summary`) and the reason a failed replay gives (:attr:`Check.reason`).

The reporter, the record, the line kinds, the judge, the replay summary, the metrics and the events
loop over the registered checks (:data:`otel_swa.checks.CHECKS`); none of them spells a check's
field names. This module and every check module import neither torch, nor OpenTelemetry, nor any
other part of otel-swa: the record is made from the checks' declarations (the checks sit below it),
and a check reaches its device kernel through what the sample hands it (:attr:`Staging.kernels`,
:mod:`otel_swa.device`, whose kernels write the cell layout the check declares).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["LINE_KINDS", "ROLES", "CheckField", "MetricRow", "Check", "InForwardCheck", "Staging", "SampleBatch",
           "AttachedCheck", "outcome_summary", "outcome_counter", "first_fault_text"]

#: The lines a check's fields are written on: ``audit`` (``otel_swa_audit=``: the slot and block
#: bookkeeping, the window and read checks) and ``provenance`` (``otel_swa_provenance=``: the checks
#: of the KV bytes and stamps held in the slots).
LINE_KINDS = ("audit", "provenance")

#: A field's role: ``fault`` (judged: its peak must stay 0; a sample where it is above 0 names its
#: first offender), ``info`` (shown with its peak, never judged), ``count`` (what was checked).
ROLES = ("fault", "info", "count")


@dataclass(frozen=True)
class CheckField:
    """One record field a check owns.

    Attributes:
        name: the record field and the key on its line (lowercase, ``swa_`` or ``kv_`` first).
        unit: UCUM unit with annotation (``{slot}``, ``{token}``, ``{query}``...).
        meaning: what the field counts, in words.
        role: one of :data:`ROLES`.
        label: what a non-zero value is, in a few words (``fault`` and ``info`` fields).
        explain: how a failure reads, a format with ``{peak}``; ``None`` for ``label``.
        nothing_found: how a fault's offender that names what was expected and found nothing reads
            (``found a slot never stamped``), or ``None``.
        gauge: ``(metric name after the namespace, description)`` of the gauge of the latest
            sample's value of this field, or ``None`` (no gauge).
    """

    name: str
    unit: str
    meaning: str
    role: str = "count"
    label: "str | None" = None
    explain: "str | None" = None
    nothing_found: "str | None" = None
    gauge: "tuple[str, str] | None" = None

    def __post_init__(self) -> None:
        problem = (f"role must be one of {', '.join(ROLES)}, got {self.role!r}" if self.role not in ROLES
                   else f"a {self.role} field needs a label" if self.role != "count" and not self.label else None)
        if problem is not None:
            raise ValueError(f"CheckField {self.name!r}: {problem}")


@dataclass(frozen=True)
class MetricRow:
    """One instrument of a check, read from its record fields at collection.

    Attributes:
        name: the metric name after the ``kv_cache.swa.`` namespace (``tokens.stale``).
        kind: ``gauge`` (the latest sample's value of ``field``) or ``sample_counter`` (the running
            sum over delivered samples, of ``field`` or of the ``outcomes``).
        unit: UCUM unit with annotation.
        description: what a data point means.
        source: the record field(s) it is read from, in words (documentation).
        field: the field a ``gauge`` or a one-series ``sample_counter`` reads.
        outcomes: ``(attribute, checks, disagree, unchecked)`` for a counter by outcome: the
            attribute key after the namespace (``read_check.outcome``), the fields of the checked,
            disagreeing and unchecked counts (``unchecked`` may be ``None``); the points are
            ``checks - disagree`` (``agree``), ``disagree`` and ``unchecked``.
    """

    name: str
    kind: str
    unit: str
    description: str
    source: str
    field: "str | None" = None
    outcomes: "tuple[str, str, str, str | None] | None" = None

    def __post_init__(self) -> None:
        if self.kind not in ("gauge", "sample_counter"):
            raise ValueError(f"MetricRow {self.name!r}: kind must be gauge or sample_counter, got {self.kind!r}")
        if (self.field is None) == (self.outcomes is None):
            raise ValueError(f"MetricRow {self.name!r}: give exactly one of field and outcomes")


def outcome_counter(name: str, unit: str, description: str, attribute: str,
                    fields: "tuple[str, str, str | None]", ran_when: str) -> MetricRow:
    """A counter by outcome (``agree``, ``disagree``, ``unchecked``) of the checked, disagreeing and
    unchecked counts ``fields`` (``unchecked`` may be ``None``), its attribute ``attribute`` after the
    namespace, its source said from the fields and ``ran_when``."""
    checks, disagree, unchecked = fields
    source = f"{checks} - {disagree} (agree), {disagree} (disagree)" + (
        f", {unchecked} (unchecked)" if unchecked else "") + f", {ran_when}"
    return MetricRow(name, "sample_counter", unit, description, source, outcomes=(attribute, checks, disagree, unchecked))


class Staging:
    """What a check's device part is given at a sampled step (built by the reporter).

    Attributes:
        kernels: the device layer, :mod:`otel_swa.device` (a check reaches its device kernel
            through it: the check modules import nothing above them).
        view: the engine's :class:`~otel_swa.views.SwaBatchView` of the sampled step.
        workspace: the reporter's :class:`~otel_swa.device.workspace.Workspace` (temporaries).
        parts: the device objects the engine switched on, by check name (a
            :class:`~otel_swa.device.read_check.ReadCheck` under ``"read"``...); a check whose
            part is absent is not staged.
        upload: ``upload(array, name)``: how a host ``int64`` numpy array reaches the device (the
            ring's pinned copy on CUDA), ``name`` keeping one staging buffer per user.
        request_ids: the batch's request ids (``view.request_ids`` as strings), or ``None``.
        core: what the core pass of the sample left for the checks fused into it (the sample's
            :class:`~otel_swa.device.sample.SampleMeta`), set before the other checks stage.
    """

    __slots__ = ("kernels", "view", "workspace", "parts", "upload", "request_ids", "core")

    def __init__(self, kernels: Any, view: Any, workspace: Any, parts: "dict[str, Any]", upload: Any,
                 request_ids: "tuple[str, ...] | None") -> None:
        self.kernels = kernels
        self.view = view
        self.workspace = workspace
        self.parts = parts
        self.upload = upload
        self.request_ids = request_ids
        self.core: Any = None


class SampleBatch:
    """What a check's offenders may name of the sampled batch (host values kept with the sample).

    Attributes:
        request_ids: the batch's request ids (``view.request_ids``, strings), or ``None``.
        page_size: the SWA page size of the slot audit carried by the same sample, 0 when the
            sample carries none (an offender then names no SWA page).
    """

    __slots__ = ("request_ids", "page_size")

    def __init__(self, request_ids: "tuple[str, ...] | None", page_size: int) -> None:
        self.request_ids = request_ids
        self.page_size = page_size

    def request(self, entry: "int | None") -> "str | None":
        """The request id of batch entry ``entry``; ``None`` for a slot no batch entry reads."""
        ids = self.request_ids
        return ids[entry] if ids is not None and entry is not None and 0 <= entry < len(ids) else None

    def swa_page(self, swa_slot: "int | None") -> "int | None":
        """The SWA page of ``swa_slot`` when the sample carries the slot audit's page size."""
        return swa_slot // self.page_size if self.page_size and swa_slot is not None else None


class Check:
    """The base of every check; a check module defines one subclass and one instance of it.

    Class attributes a check sets:
        name: short identifier (``read``, ``slot_audit``...): the key of its device part in
            :attr:`Staging.parts` and of its host values.
        title: the replay summary's row name (``read check``).
        line: one of :data:`LINE_KINDS`.
        fields: its :class:`CheckField` s, in the order its line writes them.
        counters: its counters (:class:`MetricRow` s); its gauges are its fields' ``gauge``
            (:attr:`metrics` gives both).
        ran_when: when its fields are present, in words (``when the engine gives audit inputs``).
        reason: the stderr line of a replay whose records show a fault of this check, a format
            with ``{found}`` (``name=peak`` of each fault field above 0); checks with the same text
            share one line.
        fused: the sample's core pass stages its cells (it needs the core's own gathers); its
            :meth:`stage` is then not called.
        always_summarised: the replay summary shows its row (``n/a``) even when no record has it.
    """

    name: str = ""
    title: str = ""
    line: str = "audit"
    fields: "tuple[CheckField, ...]" = ()
    counters: "tuple[MetricRow, ...]" = ()
    ran_when: str = ""
    reason: str = ""
    fused: bool = False
    always_summarised: bool = False

    # ------------------------------------------------------------------ declarations
    @functools.cached_property
    def names(self) -> "tuple[str, ...]":
        """Its field names, in line order."""
        return tuple(f.name for f in self.fields)

    @property
    def metrics(self) -> "tuple[MetricRow, ...]":
        """Its instruments: its counters, then a gauge per field that declares one."""
        return self.counters + tuple(
            MetricRow(f.gauge[0], "gauge", f.unit, f.gauge[1], f"{f.name} ({self.ran_when})", field=f.name)
            for f in self.fields if f.gauge is not None)

    @functools.cached_property
    def faults(self) -> "tuple[str, ...]":
        """Its fault fields, in line order."""
        return tuple(f.name for f in self.fields if f.role == "fault")

    def present(self, record: Any) -> bool:
        """Whether ``record`` carries this check's fields (the first is present when the check ran)."""
        return getattr(record, self.fields[0].name) is not None

    # ------------------------------------------------------------------ device side
    #: ``int64`` cells this check takes in a staged sample's row (0: none); their layout is the
    #: check's own (its module's ``*_CELLS``), which its device kernel writes.
    width: int = 0

    def default_part(self, kernels: Any, device: Any, options: "dict[str, Any]") -> Any:
        """The device part every reporter makes for this check on ``device`` without the engine
        switching it on (the slot audit's sweep, sized by the reporter's ``options``; ``kernels``:
        :mod:`otel_swa.device`), or ``None``: the engine attaches the part
        (:meth:`~otel_swa.reporter.SwaDivergenceReporter.enable_read_check`...) or the view brings
        the inputs."""
        return None

    def stage(self, staging: Staging, cells: Any) -> Any:
        """Write this check's values into ``cells`` (``int64 [width]`` on the device) at a sampled
        step, in stream order, without a host synchronisation; return what :meth:`read` needs
        besides the cells (not ``None``), or ``None`` when the check does not run at this step
        (its fields are then absent from the record)."""
        return None

    def keep(self, staging: Staging, staged: Any) -> Any:
        """Host values to keep with the sample for :meth:`read` (request ids,
        layer names...), read from the view now; default ``staged``."""
        return staged

    # ------------------------------------------------------------------ host side
    def read(self, cells: Sequence[int], kept: Any, batch: "SampleBatch") -> "tuple[dict, list[dict]]":
        """This check's record fields from its host cells (``kept``: what :meth:`keep` returned),
        and the first offender of each fault they show, as :class:`~otel_swa.record.Offender`
        keyword arguments (``fault`` first), in this check's fault order; ``batch`` names the
        sampled batch's requests and the slot audit's page size."""
        return {}, []

    def summary(self, records: Sequence[Any]) -> str:
        """The replay summary's row for ``records`` (the check's, or ``n/a`` when none has it)."""
        return "n/a"


class InForwardCheck(Check):
    """A check whose device part runs inside the engine's forward (the read and write checks): the
    part accumulates its cells there at a sampled step, and the sample copies them and clears them
    (``part.take(cells)``, on the device)."""

    def stage(self, staging: Staging, cells: Any) -> Any:
        part = staging.parts.get(self.name)
        if part is None:
            return None
        part.take(cells)
        return part


def outcome_summary(check: Check, records: Sequence[Any], words: str, alarm: str) -> str:
    """The summary row of a check whose first three fields are its checked, disagreeing and unchecked
    counts (the read and write checks): ``clean: 0 of 483 queries disagreed (62 samples)``, ``alarm``
    instead of ``clean`` when any disagreed, the unchecked count when any, the first offender."""
    checked = [r for r in records if check.present(r)]
    total, bad, unchecked = (sum(getattr(r, name) for r in checked) for name in check.names[:3])
    tail = f", {unchecked} unchecked" if unchecked else ""
    return (f"{'clean' if not bad else alarm}: {bad} of {total} {words}{tail} ({len(checked)} samples)"
            f"{first_fault_text(checked, check.names[1])}")


def first_fault_text(checked: Sequence[Any], fault: str) -> str:
    """``; first at forward_ct=N: <offender>`` of the first record with ``fault`` above 0, or ``""``."""
    first = next((r for r in checked if getattr(r, fault)), None)
    if first is None:
        return ""
    offender = first.offender(fault)
    return f"; first at forward_ct={first.forward_ct}" + (f": {offender.describe()}" if offender else "")


class AttachedCheck:
    """An in-forward check the engine runs itself, in its model runner, with what its offender
    names (the reporter's part for :meth:`~otel_swa.reporter.SwaDivergenceReporter.attach_write_check`
    and ``attach_read_check``: vLLM's runner makes its checks before the scheduler's reporter
    exists, and runs its batch in an order of its own).

    Attributes:
        check: the device check (``take(cells)`` copies and clears its cells).
        batch: returns the request ids of the step whose checks the cells hold, in the runner's
            batch order (or ``None``).
        layers: ``layer_id -> (layer name, KV cache group, rows)``.
    """

    __slots__ = ("check", "batch", "layers")
    #: what the log line of a failed ``batch()`` names
    what = "the check"

    def __init__(self, check: Any, batch: Any, layers: Any) -> None:
        self.check, self.batch, self.layers = check, batch, layers

    def take(self, cells: Any) -> None:
        self.check.take(cells)

    @staticmethod
    def kept(staged: Any) -> Any:
        """What an in-forward check keeps with a sample for an attached ``staged`` part: its
        request ids and layers (``None`` for a part the reporter runs itself)."""
        return (staged.request_ids(), staged.layers or {}) if isinstance(staged, AttachedCheck) else None

    @staticmethod
    def names(kept: Any, entry: int, layer: int) -> dict:
        """The ``request``, ``row``, ``layer_name`` and ``kv_cache_group`` of an attached check's
        offender at batch ``entry`` of ``layer`` (``kept``: :meth:`kept`'s value); the request and
        row only where the layer's entries are batch rows."""
        ids, layers = kept
        name, group, rows = layers.get(layer, (None, None, False))
        known = rows and 0 <= entry
        return dict(request=ids[entry] if known and ids is not None and entry < len(ids) else None,
                    row=entry if known else None, layer_name=name, kv_cache_group=group)

    def request_ids(self) -> "tuple[str, ...] | None":
        if self.batch is None:
            return None
        try:
            ids = self.batch()
            return None if ids is None else tuple(str(r) for r in ids)
        except Exception:
            logging.getLogger("otel_swa.reporter").exception(
                "otel-swa: %s's batch was not read; its offender names no request", self.what)
            return None
