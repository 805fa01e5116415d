"""Choosing tokens from logits: greedy argmax, or sampling with temperature / top-k / top-p.

Sampling is Gumbel-max on the filtered, tempered logits in float64 (the authors perturb
the plan step the same way; Gumbel-max with temperature T samples softmax(logits / T)).
Each request has its own generator seeded from its `DecodeConfig.seed`, so a request
samples the same tokens whether it is decoded alone or in a batch of any settings.

Confidences and verification scores are probabilities under the *unfiltered* softmax,
computed as exp(logit - logsumexp): one reduction, no vocabulary-sized copy.
"""

from __future__ import annotations

import torch

from ..settings.decode import DecodeConfig


def token_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """softmax(logits)[..., tokens] for logits (..., V) and tokens (...) -> (...) float32."""
    logits = logits.float()
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return torch.exp(picked - torch.logsumexp(logits, dim=-1))


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Logits (n, V) with everything outside top-k / the top-p nucleus set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = cum - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the token that crosses p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class Sampler:
    """Picks one request's tokens. It has its own generator, seeded from its config's
    `seed` (or at random without one), so it samples the same tokens whatever it is
    batched with."""

    def __init__(self, cfg: DecodeConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.generator: torch.Generator | None = None
        if not cfg.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(
                cfg.seed if cfg.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
            )

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """Tokens (T,) from logits (T, V)."""
        return self.draw(logits)[0]

    def draw(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens (T,) from logits (T, V), and (when sampling) the probability (T,) float64
        each had under the distribution it was drawn from (`probs`): what a speculative
        verification divides by."""
        if self.generator is None:
            return logits.argmax(-1), None
        scores = self._scores(logits)
        u = torch.rand(scores.shape, generator=self.generator, device=scores.device, dtype=torch.float64)
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
        tokens = (scores + gumbel).argmax(-1)
        picked = scores.gather(-1, tokens[:, None])[:, 0]
        return tokens, torch.exp(picked - torch.logsumexp(scores, dim=-1))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution (T, V) float64 that `draw` samples from logits (T, V): softmax
        of the tempered logits, outside top-k / top-p zero."""
        return torch.softmax(self._scores(logits), dim=-1)

    def uniform(self, n: int, device: torch.device) -> torch.Tensor:
        """n uniforms in [0, 1) (float64) from this request's generator."""
        return torch.rand(n, generator=self.generator, device=device, dtype=torch.float64)

    def from_probs(self, probs: torch.Tensor) -> int:
        """One token drawn from a distribution (V,), which need not be normalised."""
        return int(torch.multinomial(probs, 1, generator=self.generator)[0])

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        return filter_logits(logits.double() / cfg.temperature, cfg.top_k, cfg.top_p)
