"""Prometheus text-format metrics, written by hand: counters, gauges and histograms with
labels, one lock, no dependency. `Metrics` names everything the server exports."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any, TypeVar

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TPF_BUCKETS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0)

Labels = tuple[str, ...]


def _fmt(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _label_str(names: Sequence[str], values: Labels, extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


class _Metric:
    kind = ""

    def __init__(self, lock: threading.Lock, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self._lock, self.name, self.help, self.labels = lock, name, help_text, tuple(labels)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        """The metric's sample lines (each kind writes its own)."""
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._values: dict[Labels, float] = {} if self.labels else {(): 0.0}

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        with self._lock:
            return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        return [f"{self.name}{_label_str(self.labels, k)} {_fmt(v)}" for k, v in sorted(self._values.items())]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, *labels: str) -> None:
        with self._lock:
            self._values[labels] = float(value)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self,
        lock: threading.Lock,
        name: str,
        help_text: str,
        buckets: Sequence[float],
        labels: Sequence[str] = (),
    ) -> None:
        super().__init__(lock, name, help_text, labels)
        self.buckets = tuple(buckets)
        self._series: dict[Labels, list[float]] = {}  # per label set: bucket counts..., +Inf count, sum

    def observe(self, value: float, *labels: str) -> None:
        with self._lock:
            s = self._series.setdefault(labels, [0.0] * (len(self.buckets) + 2))
            for i, upper in enumerate(self.buckets):
                if value <= upper:
                    s[i] += 1
            s[-2] += 1
            s[-1] += value

    def count(self, *labels: str) -> int:
        with self._lock:
            return int(self._series[labels][-2]) if labels in self._series else 0

    def render(self) -> list[str]:
        lines = []
        for k, s in sorted(self._series.items()):
            for upper, n in zip((*self.buckets, math.inf), s[:-1]):
                le = 'le="' + _fmt(upper) + '"'
                lines.append(f"{self.name}_bucket{_label_str(self.labels, k, le)} {_fmt(n)}")
            lines.append(f"{self.name}_sum{_label_str(self.labels, k)} {_fmt(s[-1])}")
            lines.append(f"{self.name}_count{_label_str(self.labels, k)} {_fmt(s[-2])}")
        return lines


M = TypeVar("M", bound=_Metric)


class Registry:
    """Metrics rendered together, under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._all: list[_Metric] = []

    def _add(self, cls: type[M], name: str, help_text: str, **kwargs: Any) -> M:
        m = cls(self._lock, name, help_text, **kwargs)
        self._all.append(m)
        return m

    def render(self) -> str:
        with self._lock:
            lines = []
            for m in self._all:
                lines += m.header() + m.render()
        return "\n".join(lines) + "\n"


class Metrics(Registry):
    """Everything `/metrics` reports. Thread-safe: the decode thread and the event loop both write."""

    def __init__(self, prefix: str = "refusion") -> None:
        super().__init__()
        p = prefix + "_"
        self._http(p)
        self._completions(p)
        self._engine(p)
        self._queue(p)

    def _http(self, p: str) -> None:
        """HTTP requests: counts, errors, latency."""
        self.requests = self._add(
            Counter,
            p + "requests_total",
            "HTTP requests by route and status code",
            labels=("route", "status"),
        )
        self.errors = self._add(
            Counter, p + "errors_total", "Error responses by error type", labels=("type",)
        )
        self.latency = self._add(
            Histogram,
            p + "request_latency_seconds",
            "Time from request to the last byte of the response",
            buckets=LATENCY_BUCKETS,
            labels=("route",),
        )

    def _completions(self, p: str) -> None:
        """Completions: their timing, tokens and how they decoded."""
        self.ttft = self._add(
            Histogram,
            p + "time_to_first_token_seconds",
            "Time from submission to the first text of a completion",
            buckets=LATENCY_BUCKETS,
        )
        self.queue_wait = self._add(
            Histogram,
            p + "queue_wait_seconds",
            "Time a completion waited before its first engine step",
            buckets=LATENCY_BUCKETS,
        )
        self.prompt_tokens = self._add(
            Counter, p + "prompt_tokens_total", "Prompt tokens of submitted completions"
        )
        self.completion_tokens = self._add(
            Counter,
            p + "completion_tokens_total",
            "Tokens returned to clients (after max_tokens and stop cuts)",
        )
        self.generated_tokens = self._add(
            Counter, p + "generated_tokens_total", "Tokens the decoder generated"
        )
        self.forwards = self._add(
            Counter,
            p + "forward_passes_total",
            "Forward passes summed over completions (generated_tokens_total / this = overall TPF)",
        )
        self.drafting_steps = self._add(
            Counter,
            p + "drafting_steps_total",
            "ReFusion steps that drafted (plan, global verification, infilling), summed over completions",
        )
        self.ar_blocks = self._add(
            Counter,
            p + "ar_blocks_total",
            "ReFusion blocks the adaptive draft widths decoded as AR decoding does, a token per forward",
        )
        self.tpf = self._add(
            Histogram,
            p + "tokens_per_forward",
            "Tokens per forward pass (TPF) of each completion",
            buckets=TPF_BUCKETS,
        )

    def _engine(self, p: str) -> None:
        """The engine's steps: rows batched together, time, forward passes."""
        self.joined = self._add(
            Counter,
            p + "joined_total",
            "Completions added while the engine was decoding others (continuous batching)",
        )
        self.rows_per_step = self._add(
            Histogram,
            p + "rows_per_step",
            "Requests (of any settings) that took part in one engine step",
            buckets=BATCH_BUCKETS,
        )
        self.rows = self._add(Gauge, p + "rows_last_step", "Requests that took part in the last engine step")
        self.step_seconds = self._add(
            Histogram, p + "step_duration_seconds", "Wall time of one engine step", buckets=LATENCY_BUCKETS
        )
        self.engine_forwards = self._add(
            Gauge,
            p + "engine_forward_passes",
            "Model forward passes the engine has run (each shared by every row in it)",
        )

    def _queue(self, p: str) -> None:
        """How completions end, and the queue in front of the engine."""
        self.finished = self._add(
            Counter,
            p + "completions_total",
            "Completions by finish reason (stop, length, cancelled, error)",
            labels=("reason",),
        )
        self.queue_length = self._add(
            Gauge, p + "queue_length", "Completions waiting to join the engine's batch"
        )
        self.running = self._add(Gauge, p + "running_completions", "Completions the engine is decoding")
        self.rejected = self._add(
            Counter, p + "rejected_total", "Requests refused because the queue was full"
        )
