"""Evaluation: benchmarks, answer scoring, and an lm-evaluation-harness plugin; the code
sandbox's names (`refusion.sandbox`) are re-exported here.

    from refusion.evaluate import evaluate
    summary = evaluate("gsm8k", lambda prompts: refusion.generate(model, tok, prompts, cfg),
                       limit=50, out_dir="runs/gsm8k")
    summary = evaluate("humaneval", predictions="completions.jsonl")   # score without a model
"""

from ..sandbox import Check, ExecResult, Limits, SandboxError, run_check, run_checks
from .benchmarks import Benchmark, Sample, Scored
from .errors import (
    DatasetUnavailableError,
    PredictionsError,
    ResumeMismatchError,
    UnknownTaskError,
)
from .predictions import read_predictions
from .registry import BENCHMARKS, PROTOCOLS, get_benchmark
from .report import summarize, wilson_interval
from .runner import evaluate

__all__ = [
    "BENCHMARKS",
    "Benchmark",
    "Check",
    "DatasetUnavailableError",
    "ExecResult",
    "Limits",
    "PROTOCOLS",
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
