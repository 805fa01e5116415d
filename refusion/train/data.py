"""A run's examples: the training and held-out sets (tokenised, filtered), the seeded
index stream, and each process's share of a step's micro-batches."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from ..settings.model import ModelConfig
from ..settings.train import TrainConfig
from .dataset import IndexStream, TokenizedDataset, collate, load_dataset, split_eval
from .log import RunLog


class RunData:
    def __init__(
        self,
        cfg: TrainConfig,
        tokenizer,
        model_config: ModelConfig,
        eos: int | None,
        pad_id: int,
        log: RunLog,
    ) -> None:
        self.cfg, self.pad_id = cfg, pad_id
        context = model_config.max_position_embeddings
        max_length = min(cfg.max_length, context)
        if max_length < cfg.max_length:
            log.print(f"max_length {cfg.max_length} capped at the model's context, {max_length}")
        ds, stats = load_dataset(cfg.data, tokenizer, max_length, eos, context)
        log.print(stats.summary())
        self.summary = {"data": stats.summary()}
        self.train: TokenizedDataset
        self.eval: TokenizedDataset | None
        if cfg.eval_data:
            eval_ds, eval_stats = load_dataset(cfg.eval_data, tokenizer, max_length, eos, context)
            log.print(eval_stats.summary())
            self.train, self.eval = ds, eval_ds
        else:
            self.train, self.eval = split_eval(ds, cfg.eval_fraction, cfg.eval_max_examples, cfg.seed)
        self.stream: IndexStream  # set by start_stream

    def start_stream(self) -> None:
        self.stream = IndexStream(len(self.train), self.cfg.seed)

    def micro_batch(
        self, samples: int, k: int, rank: int, world: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Micro-batch k of this process: its share of the k-th global window of the stream
        from position `samples` (examples consumed by all processes so far)."""
        B = self.cfg.batch_size
        start = samples + k * B * world + rank * B
        return collate(self.train, self.stream.take(start, B), self.pad_id)

    def eval_batches(
        self, rank: int, world: int
    ) -> Iterator[tuple[int, int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        """(batch index, examples it counts for, batch) of this process's share of the held-out
        set. Every process runs the same number of batches (a collective under FSDP /
        DeepSpeed): the padding batches repeat batch 0 and count for nothing. None without
        a held-out set."""
        held_out = self.eval
        if held_out is None:
            return
        n, B = len(held_out), self.cfg.batch_size
        n_batches = math.ceil(n / B)
        for i in range(rank, math.ceil(n_batches / world) * world, world):
            start = (i if i < n_batches else 0) * B
            idx = np.arange(start, min(n, start + B))
            yield i, len(idx) if i < n_batches else 0, collate(held_out, idx, self.pad_id)
