"""The benchmarks' /metrics reader (kvflow/benchmarks/prom.py) on a page prometheus_client itself renders."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvflow.benchmarks.prom import histogram_quantile, metric_sum


def page() -> str:
    registry = CollectorRegistry()
    decisions = Counter("kvflow:prefix_fetch_decisions", "", ["path", "reason"], registry=registry)
    decisions.labels("fetch", 'a reason, with "quotes"').inc(2)
    decisions.labels("fetch", "cheaper").inc(3)
    decisions.labels("recompute", "cheaper").inc(5)
    lag = Histogram("kvflow:index_lag_seconds", "", ["worker"], buckets=(0.01, 0.1, 1.0), registry=registry)
    for worker, seconds in (("a", 0.005), ("a", 0.05), ("b", 0.05), ("b", 0.5)):
        lag.labels(worker).observe(seconds)
    return generate_latest(registry).decode()


def test_sums_by_exact_name_and_labels_whatever_the_label_values_hold() -> None:
    text = page()
    assert metric_sum(text, "kvflow:prefix_fetch_decisions_total", path="fetch") == 5
    assert metric_sum(text, "kvflow:prefix_fetch_decisions_total") == 10
    assert metric_sum(text, "kvflow:prefix_fetch_decisions_total", path="none") is None
    assert metric_sum(text, "kvflow:prefix_fetch_decisions") is None  # the family's name is no sample's


def test_histogram_quantile_sums_the_label_sets() -> None:
    text = page()
    assert histogram_quantile(text, "kvflow:index_lag_seconds", 0.5) == 0.1  # 3 of 4 under 0.1 s
    assert histogram_quantile(text, "kvflow:index_lag_seconds", 0.99) == 1.0
    assert histogram_quantile(text, "kvflow:none", 0.99) is None
