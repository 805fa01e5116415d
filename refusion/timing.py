"""Timing helpers shared by the decoder's stats and the benchmarks: synchronise the device,
time a call, size a sample, take a median."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a CUDA clock is meaningless without it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, inner: int) -> float:
    """Mean ms of `inner` back-to-back calls, synchronised at both ends."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / inner


def calibrate(fn: Callable[[], Any], device: torch.device, sample_ms: float) -> int:
    """How many calls make one sample of about sample_ms (after one warm-up call)."""
    fn()
    once = time_ms(fn, device, 1)
    return max(1, min(1000, round(sample_ms / max(once, 1e-3))))


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def median_ratio(pairs: Iterable[tuple[float, float]]) -> float:
    """The median over rounds of b / a, each (a, b) measured in one round: on a machine
    whose speed drifts, a ratio of runs moments apart, not of medians that may come from
    different minutes."""
    return statistics.median(b / a for a, b in pairs)
