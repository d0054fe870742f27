"""What every process's metrics share: the name prefix, the histogram buckets, the wire form of a
registry, and the label for a request's priority.

Each actor records into its own prometheus_client ``CollectorRegistry`` (never the global one)
with ordinary Counter, Gauge and Histogram objects. A registry travels to the ingress as a
``MetricsSnapshot`` (app/ipc/messages.py), whole and cumulative: :func:`families_of` turns a
registry into the snapshot's families and :func:`to_metric` turns a family back into a
prometheus_client ``Metric`` that the ingress's collector yields (docs/metrics.md lists every
metric). prometheus_client's multiprocess mode is not used: it fixes its storage directory at
import time, labels gauges with a pid, and leaves its files behind after a SIGKILL.

Buckets are in seconds and cover what the server does on a GPU (a decode step of ~1 ms) up to
what a CPU or an overloaded server does (minutes in the queue); each is documented in
docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

from app.ipc.messages import MetricFamily, MetricSample

PREFIX = "app:"  # every metric's name starts with it (SGLang's is "sglang:", vLLM's "vllm:")

# Request latencies, measured at the ingress.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
               0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
# The scheduler's: a request's wait for its first prefill, and one forward step's duration.
QUEUE_TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                      30.0, 60.0, 120.0, 300.0)
PREFILL_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
DECODE_STEP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
# The tokenizer's and the detokenizer's work on one request or one step's outputs.
TEXT_WORK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

# Distinct priority values that get a label value of their own; later ones share "other", so that
# clients choosing priorities cannot make the number of series grow without bound.
MAX_PRIORITY_LABELS = 16
OTHER_PRIORITY = "other"

_CREATED = "_created"  # prometheus_client's creation-time samples: not sent, not shown


def name(short: str) -> str:
    """The metric's full name: ``app:<short>``."""
    return PREFIX + short


def registry() -> CollectorRegistry:
    """A registry of one process's own metrics (not prometheus_client's global one)."""
    return CollectorRegistry(auto_describe=False)


def families_of(source: CollectorRegistry) -> tuple[MetricFamily, ...]:
    """Every metric of ``source`` as the snapshot carries it, cumulative values as they are now
    (creation-time samples left out)."""
    return tuple(
        MetricFamily(
            metric.name,
            metric.type,
            metric.documentation,
            tuple(MetricSample(s.name, tuple(s.labels.items()), s.value)
                  for s in metric.samples if not s.name.endswith(_CREATED)),
        )
        for metric in source.collect()
    )


def labelled(family: MetricFamily, labels: Sequence[tuple[str, str]]) -> MetricFamily:
    """``family`` with ``labels`` put before each sample's own (the ingress adds ``model_name``),
    except on samples that have any of them already."""
    labels = tuple(labels)
    names = {name for name, _ in labels}
    # a worker front's own metrics carry them already: theirs stay
    samples = tuple(MetricSample(s.name, s.labels if any(n in names for n, _ in s.labels) else (*labels, *s.labels),
                                 s.value) for s in family.samples)
    return MetricFamily(family.name, family.kind, family.documentation, samples)


def to_metric(family: MetricFamily) -> Metric:
    """``family`` as a prometheus_client Metric, for a collector to yield."""
    metric = Metric(family.name, family.documentation, family.kind)
    for sample in family.samples:
        metric.add_sample(sample.name, dict(sample.labels), sample.value)
    return metric


def merged(families: Iterable[MetricFamily]) -> list[MetricFamily]:
    """Families of the same name joined into one (their samples added up where name and labels
    are the same), in the order their names first appear."""
    by_name: dict[str, MetricFamily] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for family in families:
        if family.name not in by_name:
            by_name[family.name] = family
            values[family.name] = {}
        samples = values[family.name]
        for sample in family.samples:
            key = (sample.name, sample.labels)
            samples[key] = samples.get(key, 0.0) + sample.value
    return [
        MetricFamily(family.name, family.kind, family.documentation,
                     tuple(MetricSample(n, labels, value) for (n, labels), value in values[name_].items()))
        for name_, family in by_name.items()
    ]


class PriorityLabels:
    """The ``priority`` label value of a request's priority: its number for the first
    ``MAX_PRIORITY_LABELS`` distinct values seen, ``other`` after them."""

    def __init__(self, limit: int = MAX_PRIORITY_LABELS) -> None:
        if limit < 1:
            raise ValueError(f"the priority label limit must be at least 1, got {limit}")
        self.limit = limit
        self._values: dict[int, str] = {}

    def __call__(self, priority: int) -> str:
        label = self._values.get(priority)
        if label is None:
            label = str(priority) if len(self._values) < self.limit else OTHER_PRIORITY
            if label != OTHER_PRIORITY:
                self._values[priority] = label
        return label
