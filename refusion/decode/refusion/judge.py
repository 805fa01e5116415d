"""How verification judges a drafted token, and what it puts in place of one it rejects
(docs/algorithm.md#lossless-sampling).

- `Threshold`, the paper's rule: a draft passes when its AR probability (the plain softmax
  of the verify pass's logits) exceeds token_threshold; a token put in place of a failing
  one (ar_correction, first_token_check) is the request's own pick from the AR logits.
  Greedy, with the lossless settings, every accepted token is then the AR argmax.
- `Speculative`, for sampled rows whose settings are lossless at any temperature
  (`DecodeConfig.lossless`): speculative sampling (Leviathan et al. 2023, Chen et al.
  2023). A draft x, drawn from the distribution q of the pass that drafted it (the plan's,
  an infilling round's; tempered and filtered as the request says), is accepted with
  probability min(1, p(x) / q(x)), p the AR distribution at its position (the same
  transforms), conditioned on the accepted prefix; a rejected one is replaced by a draw
  from the residual max(0, p - q), normalised. The sequence drawn then has exactly the
  distribution of AR sampling of the same weights.

Both draw from the request's own generator, so a request decodes the same tokens alone
or in any batch.
"""

from __future__ import annotations

import torch

from ...settings.decode import DecodeConfig
from ..sampling import Sampler, token_probs


class Threshold:
    """The paper's verification (see the module docstring)."""

    records_q = False  # drafts need not keep the distribution they were drawn from

    def __init__(self, sampler: Sampler, tau: float) -> None:
        self.sampler, self.tau = sampler, tau

    def passes(self, logits: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor | None) -> list[bool]:
        """Whether each token (k,) passes, judged by the logits (k, V) that predict it."""
        return (token_probs(logits, tokens) > self.tau).tolist()

    def replace(self, logits: torch.Tensor, q_logits: torch.Tensor | None) -> int:
        """The token put in place of a rejected draft, from the logits (1, V) that predict it."""
        return int(self.sampler.pick(logits)[0])


class Speculative:
    """Speculative sampling's verification (see the module docstring)."""

    records_q = True  # each draft keeps its q(x), and the logits it was drawn from

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def passes(self, logits: torch.Tensor, tokens: torch.Tensor, q: torch.Tensor | None) -> list[bool]:
        """Each draft (k,) accepted with probability min(1, p(x) / q(x)): q (k,) float64
        the probability it was drawn with, p from the verify pass's logits (k, V). Every
        draft gets its uniform, so a row consumes the same draws whatever it is batched with."""
        if q is None:
            raise ValueError("speculative verification needs each draft's q(x)")
        p = self.sampler.probs(logits).gather(-1, tokens[:, None])[:, 0]  # (k,)
        u = self.sampler.uniform(len(tokens), logits.device)
        return (u * q.to(u.device) < p).tolist()

    def replace(self, logits: torch.Tensor, q_logits: torch.Tensor | None) -> int:
        """A draw from the residual max(0, p - q) (p from logits (1, V), q from the
        drafting pass's logits (V,)); where nothing was drafted, from p itself."""
        if q_logits is None:
            return int(self.sampler.pick(logits)[0])
        p = self.sampler.probs(logits)[0]  # (V,)
        residual = (p - self.sampler.probs(q_logits[None])[0]).clamp_min(0.0)
        return self.sampler.from_probs(residual if float(residual.sum()) > 0 else p)


Judge = Threshold | Speculative


def judge_for(cfg: DecodeConfig, sampler: Sampler) -> Judge:
    """Speculative sampling for sampled rows that are lossless at any temperature; the
    paper's threshold for every other row (greedy rows included: token for token as ever)."""
    if cfg.method == "refusion" and not cfg.greedy and cfg.lossless == "any temperature":
        return Speculative(sampler)
    return Threshold(sampler, cfg.token_threshold)
