"""Evaluation: benchmarks, answer scoring, a code sandbox, and an lm-evaluation-harness plugin.

    from refusion.evaluate import evaluate
    summary = evaluate("gsm8k", lambda prompts: refusion.generate(model, tok, prompts, cfg),
                       limit=50, out_dir="runs/gsm8k")
    summary = evaluate("humaneval", predictions="completions.jsonl")   # score without a model
"""

from .benchmarks import BENCHMARKS, Benchmark, Sample, Scored, get_benchmark
from .errors import (
    DatasetUnavailableError,
    PredictionsError,
    ResumeMismatchError,
    SandboxError,
    UnknownTaskError,
)
from .report import summarize, wilson_interval
from .runner import evaluate, read_predictions
from .sandbox import Check, ExecResult, Limits, run_check, run_checks

__all__ = [
    "BENCHMARKS",
    "Benchmark",
    "Check",
    "DatasetUnavailableError",
    "ExecResult",
    "Limits",
    "PredictionsError",
    "ResumeMismatchError",
    "Sample",
    "SandboxError",
    "Scored",
    "UnknownTaskError",
    "evaluate",
    "get_benchmark",
    "read_predictions",
    "run_check",
    "run_checks",
    "summarize",
    "wilson_interval",
]
