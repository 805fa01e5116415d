"""Choosing tokens from logits: greedy argmax, or sampling with temperature / top-k / top-p.

Sampling is Gumbel-max on the filtered, tempered logits in float64 (the authors perturb
the plan step the same way; Gumbel-max with temperature T samples softmax(logits / T)).
Each prompt has its own generator seeded from `DecodeConfig.seed`, so a prompt samples
the same tokens whether it is decoded alone or in a batch.

Confidences and verification scores are probabilities under the *unfiltered* softmax,
computed as exp(logit - logsumexp): one reduction, no vocabulary-sized copy.
"""

from __future__ import annotations

import torch

from .config import DecodeConfig


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
    """Picks tokens for rows of a batch; `row_ids` name each row's prompt (its generator)."""

    def __init__(self, cfg: DecodeConfig, n_prompts: int, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.generators: list[torch.Generator] | None = None if cfg.greedy else []
        self.extend(n_prompts)

    def extend(self, n: int) -> None:
        """Generators for n more prompts (joining a running batch)."""
        if self.generators is None:
            return
        # a given seed: every prompt reproducible alone or batched; no seed: each prompt its own draws
        for _ in range(n):
            g = torch.Generator(device=self.device)
            g.manual_seed(self.cfg.seed if self.cfg.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
            self.generators.append(g)

    def pick(self, logits: torch.Tensor, row_ids: list[int]) -> torch.Tensor:
        """Tokens (B, T) from logits (B, T, V); row b belongs to prompt row_ids[b]."""
        if self.generators is None:
            return logits.argmax(-1)
        out = []
        for b, rid in enumerate(row_ids):
            scores = filter_logits(logits[b].double() / self.cfg.temperature, self.cfg.top_k, self.cfg.top_p)
            u = torch.rand(scores.shape, generator=self.generators[rid], device=scores.device, dtype=torch.float64)
            gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
            out.append((scores + gumbel).argmax(-1))
        return torch.stack(out)
