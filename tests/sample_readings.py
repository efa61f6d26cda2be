"""The device-level readings of the samples a reporter delivers: each in-forward check's counts and
first offender as its device part wrote them (``otel_swa.device.read_check.read_counts``...), before
they become record fields. The in-forward checks' tests compare them across eager, recorded and
replayed runs, and read them at the step a fault was made."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import otel_swa.sampling as sampling
from otel_swa.device.read_check import read_counts, read_offender_fields
from otel_swa.device.write_check import write_counts, write_offender_fields

#: The record builder itself (patching replaces it, never wraps a patch).
_RECORD = sampling.SampleLayout.record


def reading_of(values, pending, layout) -> SimpleNamespace:
    """``read``, ``read_offender``, ``write``, ``write_offender`` and ``provenance`` (a
    ``ProvenanceReading``) of one sample's row ``values``; ``None`` for a check that did not run."""
    cells = {check.name: (values[where], pending.kept[check.name]) for check, where in layout.cells
             if check.name in pending.kept}
    read, write, prov = cells.get("read"), cells.get("write"), cells.get("provenance")
    return SimpleNamespace(
        read=read_counts(read[0]) if read else None,
        read_offender=read_offender_fields(read[0]) if read else None,
        write=write_counts(write[0]) if write else None,
        write_offender=write_offender_fields(write[0]) if write else None,
        provenance=prov[1].read(prov[0]) if prov else None,
    )


def capture(reporter: Any, readings: list, setattr: Callable[[Any, str, Any], Any]) -> None:
    """Append ``(reporter.forward_ct, reading)`` to ``readings`` for every sample ``reporter``
    delivers (read at delivery: on the CPU, at the step it was taken). ``setattr``: a patcher such
    as pytest's ``monkeypatch.setattr`` or ``mock.patch.object(...).start``-like callable."""
    def record(self, values, pending, reading, verify_source):
        readings.append((reporter.forward_ct, reading_of(values, pending, self)))
        return _RECORD(self, values, pending, reading, verify_source)

    setattr(sampling.SampleLayout, "record", record)
