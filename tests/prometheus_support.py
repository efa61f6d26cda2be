"""What each query of the Grafana dashboard must return, computed without the exporter.

A run is one or more engine processes (``tests/telemetry/prometheus_run.py``) scraped by a real
Prometheus. For each process the expected series come from:

* its records, read back from its own log lines with :func:`otel_swa.record.find_all` (SGLang's
  line and the audit line): the record gauges, the cumulative totals, the samples delivered;
* what the program recounted from the engine's tensors at each pause (slots in use per pool) and
  what the run was given (pool sizes, the SWA KV bytes per token from the KV tensors' sizes);
* for ``rate``/``increase``/``histogram_quantile``, Prometheus's raw samples of the same series
  over the same range, put through Prometheus 2's extrapolation (``extrapolatedRate`` and
  ``bucketQuantile`` of ``promql/functions.go`` / ``quantile.go``), the raw samples themselves
  being checked against the records at every pause (:func:`counter_values`).

:func:`expected` evaluates the few query shapes the dashboard uses (an aggregation ``by`` labels,
a bare selector, ``rate``/``increase`` under ``sum``, a ratio of two sums, ``histogram_quantile``);
any other shape is an error naming the query, so a new panel needs its expectation here.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_swa.record import find_all

#: Labels a result series is compared on for a bare selector (one series per process).
PROCESS_KEY = ("instance",)


@dataclass
class Process:
    """One engine process of a run: its Prometheus ``instance``, the resource labels it exports,
    its records (from its log) and what its program wrote (pauses, delays, sizes)."""

    instance: str
    job: str
    labels: dict
    log: Path
    info: dict
    records: dict = field(default_factory=dict)  # forward_ct -> record

    @classmethod
    def load(cls, out: Path, rank: int, instance: str, job: str, labels: dict) -> "Process":
        log = out / f"rank{rank}.log"
        process = cls(instance, job, labels, log, json.loads((out / f"rank{rank}.json").read_text()))
        found = find_all(log.read_text())
        assert found and not found.malformed, (log, found.errors)
        process.records = {record.forward_ct: record for record in found}
        return process

    def pause_at(self, at: float) -> dict:
        """The pause whose scrape is the latest at or before ``at`` (the process held still from it on)."""
        pauses = [p for p in self.info["pauses"] if p["scraped_at"] <= at]
        assert pauses, f"{self.instance}: no pause before {at}"
        return pauses[-1]

    def series(self, at: float) -> list[tuple[str, dict, float]]:
        """Every gauge and counter series this process exports at the pause scraped at ``at``:
        ``(prometheus name, labels, value)``, labels including ``instance`` and ``job``."""
        pause = self.pause_at(at)
        record = self.records[pause["forward_ct"]]
        delivered = [ct for ct in sorted(self.records) if ct <= pause["forward_ct"]]
        base = {**self.labels, "instance": self.instance, "job": self.job}
        out: list[tuple[str, dict, float]] = []

        def add(name: str, value: float, **labels: str) -> None:
            out.append((name, {**base, **labels}, float(value)))

        for pool in ("full", "swa"):
            used, limit = pause["pools"][pool], self.info["pool_limits"][pool]
            add("kv_cache_pool_tokens_used", used, pool=pool)
            add("kv_cache_pool_tokens_evictable", 0, pool=pool)  # no prefix cache in the reference engine
            add("kv_cache_pool_tokens_available", limit - used, pool=pool)
            add("kv_cache_pool_tokens_limit", limit, pool=pool)
            for name in ("kv_cache_pool_utilization_ratio", "kv_cache_pool_utilization"):
                add(name, used / limit, pool=pool)
        add("kv_cache_swa_memory_saved_bytes", record.swa_out_of_window_tokens * self.info["swa_bytes_per_token"])
        add("kv_cache_swa_tokens_out_of_window", record.swa_out_of_window_tokens)
        add("kv_cache_swa_tokens_divergent", record.swa_full_idx_divergence)
        add("kv_cache_swa_slots_leaked", record.swa_leaked_slots)
        add("kv_cache_swa_tokens_stale", record.swa_stale_tokens)
        add("kv_cache_swa_slots_shared", record.swa_shared_slots)
        add("kv_cache_swa_tokens_evicted_in_window", record.swa_premature_evictions)
        add("kv_cache_swa_slots_held_out_of_window", record.swa_late_held_slots)
        add("kv_cache_swa_reporter_samples_pending", 0)  # the program flushed before pausing
        # counters (their raw samples are compared with these; rates are computed from them)
        add("kv_cache_swa_forward_steps_total", record.forward_ct)
        add("kv_cache_swa_entries_verified_total", record.verify_full, pool="full", kv_cache_swa_verify_source="attention")
        add("kv_cache_swa_entries_verified_total", record.verify_swa, pool="swa", kv_cache_swa_verify_source="attention")
        checked = [self.records[ct] for ct in delivered if self.records[ct].read_checked]
        if checked:  # the read check's queries, summed over the samples, by outcome
            mismatched = sum(r.swa_read_mismatches for r in checked)
            for outcome, value in (("agree", sum(r.swa_read_checks for r in checked) - mismatched),
                                   ("disagree", mismatched), ("unchecked", sum(r.swa_read_unchecked for r in checked))):
                add("kv_cache_swa_read_check_queries_total", value, kv_cache_swa_read_check_outcome=outcome)
        add("kv_cache_swa_reporter_samples_taken_total", len(delivered))
        add("kv_cache_swa_reporter_samples_delivered_total", len(delivered))
        errors = self.log.read_text().count("not delivered")  # the reporter logs every invalid sample
        add("kv_cache_swa_reporter_samples_invalid_total", errors)
        delays = self.info["delays"][: len(delivered)]
        for bound in ("0.0", "1.0", "2.0", "3.0", "4.0", "6.0", "8.0", "16.0", "32.0", "64.0", "+Inf"):
            add("kv_cache_swa_reporter_delivery_delay_bucket", sum(1 for d in delays if d <= float(bound)), le=bound)
        return out


# ------------------------------------------------------------------ Prometheus 2's rate and quantile
def extrapolated_rate(samples: list[tuple[float, float]], at: float, range_s: float, is_rate: bool) -> float | None:
    """``rate``/``increase`` of one counter series' raw samples in ``[at - range_s, at]``
    (Prometheus 2.42 ``extrapolatedRate``, in its integer milliseconds: counter resets,
    extrapolation to the range's ends unless farther than 1.1 average intervals, not past the
    counter's zero). ``None``: fewer than 2 samples."""
    end_ms, range_ms = round(at * 1000), round(range_s * 1000)
    start_ms = end_ms - range_ms
    points = [(round(t * 1000), v) for t, v in samples if start_ms <= round(t * 1000) <= end_ms]
    if len(points) < 2:
        return None
    result = points[-1][1] - points[0][1]
    previous = points[0][1]
    for _, v in points[1:]:
        if v < previous:
            result += previous
        previous = v
    duration_to_start = (points[0][0] - start_ms) / 1000
    duration_to_end = (end_ms - points[-1][0]) / 1000
    sampled = (points[-1][0] - points[0][0]) / 1000
    average = sampled / (len(points) - 1)
    if result > 0 and points[0][1] >= 0:
        duration_to_zero = sampled * (points[0][1] / result)
        if duration_to_zero < duration_to_start:
            duration_to_start = duration_to_zero
    threshold = average * 1.1
    interval = sampled
    interval += duration_to_start if duration_to_start < threshold else average / 2
    interval += duration_to_end if duration_to_end < threshold else average / 2
    result *= interval / sampled
    return result / (range_ms / 1000) if is_rate else result


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus 2.42 ``bucketQuantile`` over ``(upper bound, cumulative count)`` pairs."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][0] != math.inf or len(buckets) < 2:
        return math.nan
    total = buckets[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    b = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    if b == 0 and buckets[0][0] <= 0:
        return buckets[0][0]
    start, end = (0.0, buckets[0][0]) if b == 0 else (buckets[b - 1][0], buckets[b][0])
    below = 0.0 if b == 0 else buckets[b - 1][1]
    count = buckets[b][1] - below
    return start + (end - start) * ((rank - below) / count)


# ------------------------------------------------------------------ the query shapes of the dashboard
_SELECTOR = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?$")


def _matchers(text: str) -> list[tuple[str, str, str]]:
    return re.findall(r'(\w+)\s*(=~|=)\s*"([^"]*)"', text or "")


def _matches(labels: dict, matchers: list[tuple[str, str, str]]) -> bool:
    for label, op, wanted in matchers:
        have = labels.get(label, "")
        if op == "=" and have != wanted or op == "=~" and not re.fullmatch(wanted, have):
            return False
    return True


def _split_top(expr: str, sep: str) -> list[str]:
    depth, parts, start = 0, [], 0
    for i, c in enumerate(expr):
        depth += c in "({["
        depth -= c in ")}]"
        if depth == 0 and expr.startswith(sep, i):
            parts.append(expr[start:i])
            start = i + len(sep)
    return parts + [expr[start:]]


def _group(series: list[tuple[dict, float]], by: list[str] | None, how: str) -> dict:
    groups: dict = {}
    for labels, value in series:
        key = tuple((label, labels.get(label, "")) for label in by) if by is not None else _process_key(labels)
        groups.setdefault(key, []).append(value)
    combine = {"sum": sum, "max": max, "min": min}.get(how)
    return {key: (combine(values) if combine else values[0]) for key, values in groups.items()}


def _process_key(labels: dict) -> tuple:
    return tuple((label, labels.get(label, "")) for label in PROCESS_KEY)


def result_key(metric: dict, by: list[str] | None) -> tuple:
    """The key of a result series under the query's grouping (``None``: one series per process)."""
    if by is None:
        return _process_key(metric)
    return tuple((label, metric.get(label, "")) for label in by)


@dataclass
class Expected:
    """What a query must return: ``values`` by key (:func:`result_key` of ``by``), compared with
    relative tolerance ``rel`` (0 for exact integers)."""

    by: list[str] | None
    values: dict
    rel: float = 0.0


def expected(expr: str, processes: list[Process], at: float, raw: Any) -> Expected:
    """The expected result of ``expr`` (Grafana variables already replaced) at time ``at``.

    ``raw(selector_with_range, at)`` returns Prometheus's raw samples (the result of an instant
    query of a range vector selector), for the ``rate``/``increase`` shapes.

    Raises:
        ValueError: a shape this evaluator does not know (the message names the query).
    """
    expr = expr.strip()
    parts = _split_top(expr, " / ")
    if len(parts) == 2:
        top, bottom = (expected(part, processes, at, raw) for part in parts)
        assert top.by == bottom.by == [], expr
        values = {key: top.values[key] / bottom.values[key] for key in top.values if key in bottom.values}
        return Expected([], values, 1e-9)
    match = re.fullmatch(r"histogram_quantile\(([0-9.]+),\s*sum by \(le\) \((.*)\)\)", expr)
    if match:
        q, inner = float(match.group(1)), match.group(2)
        rates = _rates(inner, processes, at, raw)
        buckets: dict = {}
        for labels, value in rates:
            bound = math.inf if labels["le"] == "+Inf" else float(labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + value
        return Expected([], {(): bucket_quantile(q, list(buckets.items()))}, 1e-9)
    match = re.fullmatch(r"(sum|max|min)(?: by \(([^)]*)\))? ?\((.*)\)", expr)
    if match:
        how, by, inner = match.group(1), match.group(2), match.group(3).strip()
        labels = [label.strip() for label in by.split(",")] if by else []
        if re.match(r"(rate|increase)\(", inner):
            series = _rates(inner, processes, at, raw)
        else:
            series = _select(inner, processes, at)
        return Expected(labels, _group(series, labels, how), 1e-9 if inner.startswith(("rate", "increase")) else 1e-12)
    if _SELECTOR.match(expr):
        return Expected(None, _group(_select(expr, processes, at), None, "one"), 1e-12)
    raise ValueError(f"no expectation for the shape of {expr!r}")


def _select(selector: str, processes: list[Process], at: float) -> list[tuple[dict, float]]:
    either = _split_top(selector, " or ")
    if len(either) > 1:  # PromQL "or": the left side's series, then the right side's of other label sets
        out, seen = [], set()
        for part in either:
            for labels, value in _select(part, processes, at):
                key = tuple(sorted(labels.items()))
                if key not in seen:
                    seen.add(key)
                    out.append((labels, value))
        return out
    match = _SELECTOR.match(selector.strip())
    if not match:
        raise ValueError(f"no expectation for the shape of {selector!r}")
    name, matchers = match.group(1), _matchers(match.group(2))
    return [(labels, value) for p in processes for n, labels, value in p.series(at)
            if n == name and _matches(labels, matchers)]


def _rates(inner: str, processes: list[Process], at: float, raw: Any) -> list[tuple[dict, float]]:
    match = re.fullmatch(r"(rate|increase)\((.*)\[(\d+)ms\]\)", inner.strip())
    if not match:
        raise ValueError(f"no expectation for the shape of {inner!r}")
    function, selector, range_ms = match.group(1), match.group(2), int(match.group(3))
    instances = {p.instance for p in processes}
    out = []
    for series in raw(f"{selector}[{range_ms}ms]", at):
        if series["metric"].get("instance") not in instances:
            continue
        samples = [(float(t), float(v)) for t, v in series["values"]]
        value = extrapolated_rate(samples, at, range_ms / 1000, function == "rate")
        if value is not None:
            out.append((series["metric"], value))
    return out


def counter_values(processes: list[Process], at: float) -> dict:
    """(name, instance, sorted labels that matter) -> value of every counter series at the pause
    scraped at ``at``, for the comparison with Prometheus's raw samples."""
    out = {}
    for p in processes:
        for name, labels, value in p.series(at):
            if name.endswith(("_total", "_bucket")):
                out[(name, p.instance, labels.get("pool", ""), labels.get("le", ""),
                     labels.get("kv_cache_swa_read_check_outcome", ""))] = value
    return out
