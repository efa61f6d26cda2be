"""Both ways the sample's live path counts its masks, whatever the number of live tokens: by its one
cumsum (as for a few live tokens) or each by a flat count (as above
``otel_swa.device.sample_live.TALLY_ALL_MAX``)."""

import contextlib

from otel_swa.device import sample_live


@contextlib.contextmanager
def tallied_by(how):
    """``how``: ``"cumsum"`` or ``"counts"``, for the live samples staged inside the block."""
    kept = sample_live.TALLY_ALL_MAX
    sample_live.TALLY_ALL_MAX = 2**62 if how == "cumsum" else 0
    try:
        yield
    finally:
        sample_live.TALLY_ALL_MAX = kept
