"""Engine views: the protocol the reporter reads, and one adapter per engine."""

from otel_swa.views.base import JoinedTokenIds, SwaAuditInputs, SwaBatch, SwaBatchView, validate_view

__all__ = ["JoinedTokenIds", "SwaAuditInputs", "SwaBatch", "SwaBatchView", "validate_view"]
