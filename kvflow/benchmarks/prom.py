"""The benchmarks' reading of a /metrics page, through prometheus_client's own parser (label values may hold
spaces, commas or escaped quotes, which splitting lines by hand gets wrong)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def samples(text: str, name: str) -> list[Sample]:
    """Every sample named exactly `name` (a counter's is `<family>_total`; its `_created` is another name)."""
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def metric_sum(text: str, name: str, **labels: str) -> float | None:
    """The sum of `name`'s samples whose labels include `labels`; None where the page has none."""
    values = [s.value for s in samples(text, name) if all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(values) if values else None


def histogram_quantile(text: str, name: str, quantile: float) -> float | None:
    """The upper bound of the bucket holding `quantile` of `name`'s observations, its label sets summed; None
    before any observation."""
    counts: dict[float, float] = {}
    for s in samples(text, f"{name}_bucket"):
        bound = float(s.labels["le"])  # "+Inf" parses as inf
        counts[bound] = counts.get(bound, 0.0) + s.value
    if not counts or max(counts.values()) == 0:
        return None
    total = counts[max(counts)]
    return next(bound for bound, count in sorted(counts.items()) if count >= quantile * total)
