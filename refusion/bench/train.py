"""`refusion bench train [MODEL]`: training tokens/s with the ReFusion objective and with
plain next-token (AR) training of the same model on the same batch, side by side.

A step is what `refusion train` does per micro-batch: build the objective's batch (on the
CPU, copied to the device), forward to the logits of the labelled tokens, weighted
cross-entropy, backward, clip, AdamW. The two objectives alternate in ABBA order over the
repeats, so drift of a noisy machine (clock, neighbours) falls on both; the figures are
medians over repeats.
Tokens are the non-padding tokens fed (prompt + response), the same count both ways.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..errors import ConfigError
from ..model.transformer import Transformer
from ..train import LossModel, init_weights, step_generator, step_inputs
from ..train.objective import ObjectiveConfig, weighted_loss
from .results import add_results_argument, writes_results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", default=None, help="model directory or hub id (default: the bundled model)"
    )
    parser.add_argument(
        "--init-config", default=None, help="bench a randomly initialised model from this config.json"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="examples per step (default: 8)")
    parser.add_argument(
        "--seq-len", type=int, default=256, help="tokens per example, prompt + response (default: 256)"
    )
    parser.add_argument(
        "--prompt-frac", type=float, default=0.25, help="mean share of the prompt (default: 0.25)"
    )
    parser.add_argument(
        "--steps", type=int, default=3, help="timed steps per repeat and objective (default: 3)"
    )
    parser.add_argument("--repeats", type=int, default=6, help="alternating repeats (default: 6)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    parser.add_argument(
        "--precision",
        choices=("auto", "no", "bf16"),
        default="auto",
        help="autocast (auto: bf16 on a GPU that has it)",
    )
    parser.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute activations in backward"
    )
    parser.add_argument("--seed", type=int, default=0)
    add_results_argument(parser, "training.md")


@writes_results
def run(args: argparse.Namespace) -> int:
    with torch.enable_grad():  # also when called from a no_grad context
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    model = _model(args, device)
    mask_id = model.config.mask_token_id
    if mask_id is None:
        raise ConfigError("the model has no MASK token: run `refusion convert` on it first")
    gpu_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    bf16 = args.precision == "bf16" or (args.precision == "auto" and gpu_bf16)
    tokens, prompt_lens, lengths = _synthetic_batch(args, model.config.vocab_size, mask_id)
    loss_model = LossModel(model).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    obj_cfg = ObjectiveConfig()
    n_tokens = int(lengths.sum())
    timings: dict[str, list[float]] = {"refusion": [], "ar": []}  # tokens/s of each repeat
    shares: list[float] = []

    def step(objective: str, i: int) -> float:
        """One training step as `refusion train` takes it; returns the CPU seconds spent
        building the objective's batch."""
        t0 = time.perf_counter()
        gen = step_generator(args.seed, i)
        ids, pos, targets = step_inputs(
            objective, tokens, prompt_lens, lengths, mask_id, obj_cfg, gen, device
        )
        t_obj = time.perf_counter() - t0
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = loss_model(ids, pos, targets.flat_index)
        weighted_loss(logits, targets).total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return t_obj

    for objective in ("refusion", "ar"):  # warm-up: allocator, kernels, autotuning
        step(objective, 0)
    for r in range(args.repeats):
        order = ("refusion", "ar") if r % 2 == 0 else ("ar", "refusion")
        for objective in order:
            t0 = _now(device)
            t_obj = sum(step(objective, r * args.steps + i) for i in range(args.steps))
            elapsed = _now(device) - t0
            timings[objective].append(args.steps * n_tokens / elapsed)
            if objective == "refusion":
                shares.append(t_obj / elapsed)

    _report(args, model, device, bf16, n_tokens, timings, shares)
    return 0


def _model(args: argparse.Namespace, device: torch.device) -> Transformer:
    if args.init_config is not None:
        from ..settings.model import ModelConfig

        config = ModelConfig.from_json(args.init_config)
        if config.mask_token_id is None:
            config.mask_token_id = config.vocab_size - 1
        torch.manual_seed(args.seed)
        model = init_weights(Transformer(config))
    else:
        from ..io import load

        model, _ = load(args.model, device="cpu", dtype="float32")
    model.gradient_checkpointing = args.gradient_checkpointing
    return model.to(device)


def _synthetic_batch(args, vocab: int, mask_id: int):
    """Random tokens (never MASK), full rows of seq_len, prompt lengths around prompt_frac,
    on the CPU (where `refusion train` builds its batches)."""
    gen = torch.Generator().manual_seed(args.seed)
    B, T = args.batch_size, args.seq_len
    tokens = torch.randint(vocab - 1, (B, T), generator=gen)
    tokens = torch.where(tokens >= mask_id, tokens + 1, tokens)
    lo, hi = max(1, int(0.5 * args.prompt_frac * T)), max(2, int(1.5 * args.prompt_frac * T))
    prompt_lens = torch.randint(lo, min(hi, T - 1) + 1, (B,), generator=gen)
    lengths = torch.full((B,), T)
    return tokens, prompt_lens, lengths


def _now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _report(args, model: Transformer, device, bf16: bool, n_tokens: int, timings: dict, shares: list) -> None:
    rf, ar = statistics.median(timings["refusion"]), statistics.median(timings["ar"])
    name = args.init_config or args.model or "bundled model"
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({torch.get_num_threads()} threads)"
    )
    print(f"model      {name}: {model.num_parameters() / 1e6:.2f}M parameters")
    print(f"device     {where}, {'bf16 autocast' if bf16 else 'float32'}")
    print(
        f"batch      {args.batch_size} x {args.seq_len} tokens ({n_tokens} per step), "
        f"{args.repeats} alternating repeats x {args.steps} steps"
    )
    print(f"{'objective':<10} {'tokens/s':>12} {'min':>12} {'max':>12}")
    for label, key in (("refusion", "refusion"), ("ar", "ar")):
        xs = timings[key]
        print(f"{label:<10} {statistics.median(xs):>12.0f} {min(xs):>12.0f} {max(xs):>12.0f}")
    print(f"ratio      refusion / ar = {rf / ar:.3f}x")
    print(f"objective  batch construction = {100 * statistics.median(shares):.2f}% of a ReFusion step")
