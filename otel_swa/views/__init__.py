"""Engine views: the protocol the reporter reads, and one adapter per engine."""

from otel_swa.views.base import SwaBatch, SwaBatchView, validate_view

__all__ = ["SwaBatch", "SwaBatchView", "validate_view"]
