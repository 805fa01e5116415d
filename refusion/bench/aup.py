"""AUP (Accuracy Under Parallelism): one number for a method's accuracy-parallelism curve.

Definition (d3LLM, Qian et al. 2026; the blog "AUP: when Accuracy Meets Parallelism in
Diffusion Language Models", hao-ai-lab.github.io/blogs/text-diffusion, section "AUP:
Considering Both Performance and Parallelism"; the leaderboard's reference code is
`get_aup` in d3LLM_Code/aup_utils.py of huggingface.co/spaces/d3LLM/dLLM_Leaderboard):

    S = {(rho_i, y_i)} sorted so that rho_1 < ... < rho_m, rho = tokens per forward (TPF),
    y = accuracy in percent. Keep only points with y_i >= y_min = y_1 - 5 (y_1 is the
    accuracy at the lowest parallelism). Then

        AUP = rho_1 * y_1 + 1/2 * sum_{i=2..m} (rho_i - rho_{i-1}) * (y_i W(y_i) + y_{i-1} W(y_{i-1}))
        W(y) = min(exp(-alpha * (1 - y / y_max)), 1),  alpha = 3,

    y_max being the highest accuracy any method reaches on the task (the leaderboard takes
    the maximum over every point of every method).

One deliberate difference from the reference code: it also asserts that the point of
highest parallelism is within 5 points of y_1 (a check on the leaderboard's hand-entered
data); a sweep legitimately produces such points, so here they are filtered out, as the
formula in the blog says, rather than rejected.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def aup_weight(y: float, y_max: float, alpha: float = 3.0) -> float:
    """W(y): 1 at the best accuracy, decaying exponentially with the relative shortfall."""
    return min(math.exp(-alpha * (1.0 - y / y_max)), 1.0)


def aup(
    points: Sequence[tuple[float, float]], y_max: float, alpha: float = 3.0, y_min_offset: float = 5.0
) -> float:
    """AUP of one method's (TPF, accuracy %) points; `y_max` is the best accuracy (%) of
    any method on the task. A single point (an AR decoder: TPF 1) scores TPF x accuracy."""
    if not points:
        raise ValueError("AUP needs at least one (parallelism, accuracy) point")
    if any(rho <= 0 for rho, _ in points):
        raise ValueError("parallelism (TPF) must be positive")
    if y_max <= 0:  # every accuracy is 0: each term is 0 (and W is undefined)
        return 0.0
    ordered = sorted(points, key=lambda p: p[0])
    y_min = ordered[0][1] - y_min_offset
    kept = [(rho, y) for rho, y in ordered if y >= y_min]
    total = kept[0][0] * kept[0][1]
    for (rho_prev, y_prev), (rho, y) in zip(kept, kept[1:]):
        total += (
            0.5
            * (rho - rho_prev)
            * (y * aup_weight(y, y_max, alpha) + y_prev * aup_weight(y_prev, y_max, alpha))
        )
    return total
