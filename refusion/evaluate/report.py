"""The summary of a run: accuracy with a Wilson 95% interval, speed, latency percentiles."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

Z95 = 1.959963984540054  # two-sided 95% normal quantile
GENERATION_ERROR = (
    "generation_error"  # a sample's reason when the model gave no output (too long a prompt, say)
)


def wilson_interval(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion; (0, 1) when n is 0."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _sum(records: Iterable[dict], key: str) -> float | None:
    values = [r["stats"][key] for r in records if r.get("stats") and r["stats"].get(key) is not None]
    return sum(values) if values else None


def summarize(records: Sequence[dict], extracts: bool = True) -> dict:
    """Accuracy and speed over per-sample records (as written to samples.jsonl).
    `no_answer` counts outputs with no answer found in them, for benchmarks that look for
    one (`extracts`); None for those whose checker judges the whole text. Samples that
    failed to generate are `generation_errors`.

    tps is single-stream speed, tokens / seconds each sequence took (the paper's figure
    at batch size 1); throughput is tokens / generation seconds of the run (batching helps).
    """
    n = len(records)
    correct = sum(bool(r["correct"]) for r in records)
    lo, hi = wilson_interval(correct, n)
    summary: dict = {
        "n": n,
        "correct": correct,
        "accuracy": correct / n if n else None,
        "ci95": [lo, hi],
        "no_answer": sum(r.get("extracted") is None for r in records) if extracts else None,
        "generation_errors": sum(_reason(r) == GENERATION_ERROR for r in records),
    }
    metrics = _metric_means(records)
    if metrics:
        summary["metrics"] = metrics
    tokens, nfe, wall = _sum(records, "tokens"), _sum(records, "nfe"), _sum(records, "wall_time")
    gen_seconds = sum(r.get("gen_seconds") or 0.0 for r in records)
    latencies = [
        r["stats"]["wall_time"] for r in records if r.get("stats") and r["stats"].get("wall_time") is not None
    ]
    summary.update(
        tokens=tokens,
        tokens_mean=tokens / n if tokens is not None and n else None,
        nfe_mean=nfe / n if nfe is not None and n else None,
        tpf=tokens / nfe if tokens is not None and nfe else None,
        tps=tokens / wall if tokens is not None and wall else None,
        throughput=tokens / gen_seconds if tokens is not None and gen_seconds else None,
        latency_s={
            "mean": sum(latencies) / len(latencies) if latencies else None,
            "p50": percentile(latencies, 50),
            "p90": percentile(latencies, 90),
            "p99": percentile(latencies, 99),
            "max": max(latencies) if latencies else None,
        },
    )
    return summary


def _metric_means(records: Sequence[dict]) -> dict[str, float]:
    """Each metric the benchmark reports per sample (`detail.metrics`, as lm-eval names
    them), averaged over all samples: one that failed to generate scores 0."""
    names: list[str] = []
    for r in records:
        names += [k for k in ((r.get("detail") or {}).get("metrics") or {}) if k not in names]
    return {
        k: sum(bool(((r.get("detail") or {}).get("metrics") or {}).get(k)) for r in records) / len(records)
        for k in names
    }


def _reason(record: dict) -> str | None:
    return (record.get("detail") or {}).get("reason")


def one_line(task: str, summary: dict) -> str:
    if not summary["n"]:
        return f"{task}: no samples"
    lo, hi = summary["ci95"]
    line = (
        f"{task}: accuracy {100 * summary['accuracy']:.2f}% ({summary['correct']}/{summary['n']}, "
        f"95% CI {100 * lo:.1f}-{100 * hi:.1f})"
    )
    if summary.get("tps") is not None:
        line += f", {summary['tps']:.1f} tok/s, TPF {summary['tpf']:.2f}, NFE {summary['nfe_mean']:.1f}"
    if len(summary.get("metrics") or {}) > 1:
        line += "; " + ", ".join(f"{k} {100 * v:.2f}%" for k, v in summary["metrics"].items())
    if summary.get("resumed"):
        line += f"; {summary['resumed']} of {summary['n']} samples resumed from an earlier run"
    if summary.get("generation_errors"):
        line += f"; {summary['generation_errors']} failed to generate (scored wrong)"
    return line
