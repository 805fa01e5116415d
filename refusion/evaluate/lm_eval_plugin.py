"""lm-evaluation-harness model `refusion`: any lm-eval task on a ReFusion model.

- generate_until: every request with its own DecodeConfig (a preset, the model_args, then
  the request's temperature, and its `until` as stop strings, which end the row early),
  all in one `refusion.generate` call: the engine batches any mix of settings (model_args
  `max_batch_size` and `batch_size` bound it). lm-eval has already formatted the context
  (and applied the chat template with --apply_chat_template), so we generate with
  chat=False.
- generation length: model_args `gen_length=N`, else the preset's (the authors' 512),
  else the task's `max_gen_toks`, else the checkpoint's recommendation; `gen_length=task`
  takes each task's `max_gen_toks` even with a preset.
- `protocol=paper` generates as the authors' eval.py did: the chat template rendered with
  `enable_thinking=True`, the full length generated, then cut at `until` and the first
  python block kept (`paper_rules.finish`). With it, their own task files run as they
  ran them (from a checkout of their repository, whose lm_eval/tasks holds the tasks
  they edited):

      python -m refusion.evaluate.lm_eval_plugin run --model refusion \\
          --model_args pretrained=GSAI-ML/ReFusion,preset=gsm8k,protocol=paper \\
          --include_path ReFusion/lm_eval/tasks --tasks gsm8k_cot --num_fewshot 0 \\
          --apply_chat_template --log_samples --output_path out/gsm8k_cot
- loglikelihood / loglikelihood_rolling: plain AR scoring by the same model, in one
  forward per batch, `model(tokens, positions)` with positions = arange (right padding
  does not disturb a causal model: pads come after every scored token).

lm-eval 0.4.x finds models through its registry, which it fills by importing its own
modules; it does not read the `lm_eval.models` entry point that our pyproject declares.
So importing this module registers the model (`@register_model("refusion")`), and
`python -m refusion.evaluate.lm_eval_plugin ARGS` runs lm-eval's CLI with it registered:

    python -m refusion.evaluate.lm_eval_plugin run --model refusion \\
        --model_args pretrained=PATH,preset=gsm8k --tasks gsm8k_cot --apply_chat_template
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .paper import TEMPLATE_OPTIONS
from .paper_rules import finish

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as e:  # an optional extra
    raise ImportError("the lm-evaluation-harness plugin needs lm-eval: pip install lm-eval") from e


@register_model("refusion")
class ReFusionLM(LM):
    """`--model refusion --model_args pretrained=PATH,method=refusion,preset=gsm8k,batch_size=4`.

    Python callers may pass `model` and `tokenizer` objects instead of `pretrained`, and
    `generate_fn` (default `refusion.generate`) to stand in for the decoder.
    """

    def __init__(
        self,
        pretrained: str | None = None,
        method: str | None = None,
        preset: str | None = None,
        gen_length: int | str | None = None,
        protocol: str = "robust",
        batch_size: int | str = 1,
        max_length: int | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        quantize: str | None = None,
        model: Any = None,
        tokenizer: Any = None,
        generate_fn: Callable | None = None,
        **decode_overrides: Any,
    ) -> None:
        super().__init__()
        if model is None:
            from ..io import load

            model, tokenizer = load(pretrained, device=device, dtype=dtype, quantize=quantize)
        self.model, self.tokenizer = model.eval(), tokenizer
        self.pretrained = pretrained
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 1  # "auto" -> 1
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 2048
        self.max_length = min(int(max_length), limit) if max_length else limit
        self._generate_fn = generate_fn
        if protocol not in ("robust", "paper"):
            from ..errors import ConfigError

            raise ConfigError(f"protocol takes robust or paper, got {protocol!r}")
        self.protocol = protocol
        if gen_length is not None and gen_length != "task" and not str(gen_length).isdigit():
            from ..errors import ConfigError

            raise ConfigError(
                "gen_length takes a number of tokens or 'task' (each task's max_gen_toks), "
                f"got {gen_length!r}"
            )
        self._gen_length = gen_length if gen_length in (None, "task") else int(gen_length)
        self._decode, self._engine = _split_model_args(
            {"method": method, "preset": preset, **decode_overrides}, self.batch_size
        )

    # ------------------------------------------------------------------- tokenisation
    @property
    def tokenizer_name(self) -> str:
        return str(self.pretrained or "refusion-bundled").replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if isinstance(chat_template, str):
            return chat_template
        return getattr(self.tokenizer, "chat_template", None) or ""

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        from ..model.prompts import chat_text

        options = dict(TEMPLATE_OPTIONS) if self.protocol == "paper" else {}
        return chat_text(self.tokenizer, chat_history, add_generation_prompt, **options)

    def _encode(self, text: str) -> list[int]:
        from ..model.prompts import tokenize

        return tokenize(self.tokenizer, text, add_special_tokens=False)

    @property
    def _prefix_id(self) -> int:
        """The token that conditions a text with no context."""
        tok = self.tokenizer
        for value in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id):
            if value is not None:
                return int(value)
        return 0

    # ------------------------------------------------------------------- generation
    def _config(self, gen_kwargs: dict):
        """The request's DecodeConfig: the checkpoint's recommended settings, the preset, the
        model_args' fields, then the task's generation kwargs (temperature, until as stop
        strings unless the paper protocol cuts afterwards), and the generation length (see
        the module's docstring)."""
        from ..settings.decode import DecodeConfig
        from ..settings.recommended import recommended_of

        d = dict(self._decode)
        preset = d.pop("preset", None)
        base = recommended_of(self.model).decode_config()
        cfg = DecodeConfig.preset(preset, base) if preset else base
        overrides = {k: v for k, v in d.items() if v is not None}
        if gen_kwargs.get("do_sample") is False:
            overrides["temperature"] = 0.0
        elif gen_kwargs.get("temperature") is not None:
            overrides["temperature"] = float(gen_kwargs["temperature"])
        overrides["stop"] = () if self.protocol == "paper" else _until(gen_kwargs)
        cfg = cfg.replace(**overrides)
        task_length = gen_kwargs.get("max_gen_toks")
        if isinstance(self._gen_length, int):
            return cfg.for_max_tokens(self._gen_length)
        if task_length and (self._gen_length == "task" or not preset):
            return cfg.for_max_tokens(int(task_length))
        return cfg

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from tqdm.auto import tqdm

        generate = self._generate_fn
        if generate is None:
            from ..decode.api import generate as engine_generate

            generate = engine_generate
        contexts = [r.args[0] for r in requests]
        cfgs = [self._config(dict(r.args[1])) for r in requests]  # each request its own settings, one batch
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until")

        def on_output(_i: int, out: Any) -> None:
            if out.finished:
                bar.update(1)

        outputs = generate(
            self.model,
            self.tokenizer,
            contexts,
            cfgs,
            engine_config=self._engine,
            chat=False,
            on_output=on_output,
        )
        results: list[str] = []
        for request, context, out in zip(requests, contexts, outputs):
            text = out if isinstance(out, str) else out.text  # cut at max_gen_toks and the stop strings
            if self.protocol == "paper":
                raw = (
                    self.tokenizer.decode(list(out.token_ids), skip_special_tokens=False)
                    if hasattr(out, "token_ids")
                    else text
                )
                text = finish(raw, _until(dict(request.args[1])), self.tokenizer)
            results.append(text)
            self.cache_hook.add_partial("generate_until", (context, request.args[1]), text)
        bar.close()
        return results

    # ---------------------------------------------------------------- loglikelihood
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for request in requests:
            context, continuation = request.args[0], request.args[1]
            spaces = len(context) - len(context.rstrip())
            if spaces:  # a context's trailing spaces belong to the continuation's first token
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            if context:
                whole, ctx = self._encode(context + continuation), self._encode(context)
                pairs.append((whole[: len(ctx)], whole[len(ctx) :]))
            else:
                pairs.append(([self._prefix_id], self._encode(continuation)))
        results = self._score(pairs, disable_tqdm)
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-text log-likelihood in disjoint windows of max_length, each conditioned on
        the token before it (the prefix token for the first)."""
        out = []
        for request in requests:
            tokens = [self._prefix_id] + self._encode(request.args[0])
            step = self.max_length - 1
            windows = [
                (tokens[i : i + 1], tokens[i + 1 : i + 1 + step]) for i in range(0, len(tokens) - 1, step)
            ]
            total = sum(ll for ll, _ in self._score(windows, True))
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            out.append(total)
        return out

    @torch.inference_mode()
    def _score(
        self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool
    ) -> list[tuple[float, bool]]:
        """(sum log p(continuation | context), continuation is the greedy one) per pair."""
        from tqdm.auto import tqdm

        results: dict[int, tuple[float, bool]] = {}  # filled longest pair first
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        device = next(self.model.parameters()).device
        for start in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm, desc="loglikelihood"):
            chunk = order[start : start + self.batch_size]
            rows = []
            for i in chunk:
                context, continuation = pairs[i]
                full = (context + continuation)[-(self.max_length + 1) :]  # keep the right end
                rows.append((full[:-1], min(len(continuation), len(full) - 1)))
            width = max(len(r) for r, _ in rows)
            tokens = torch.zeros(len(rows), width, dtype=torch.long)
            for b, (row, _) in enumerate(rows):
                tokens[b, : len(row)] = torch.tensor(row)
            positions = torch.arange(width).expand(len(rows), width)
            logprobs = F.log_softmax(self.model(tokens.to(device), positions.to(device)).float(), dim=-1)
            for b, i in enumerate(chunk):
                row, n = rows[b]
                target = torch.tensor(pairs[i][1][-n:] if n else [], dtype=torch.long, device=device)
                lp = logprobs[b, len(row) - n : len(row)]  # (n, V): the logits before each target
                picked = lp.gather(-1, target[:, None]).squeeze(-1)
                results[i] = (float(picked.sum()), bool((lp.argmax(-1) == target).all()))
        return [results[i] for i in range(len(pairs))]


def main() -> None:
    """lm-eval's own command line, with the `refusion` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


def _until(gen_kwargs: dict) -> tuple[str, ...]:
    until = gen_kwargs.get("until") or []
    return tuple(s for s in ([until] if isinstance(until, str) else until) if s)


def _split_model_args(args: dict[str, Any], batch_size: int):
    """model_args into DecodeConfig fields (and `preset`) and an EngineConfig; a name that
    is neither is an error that lists the names accepted."""
    from ..settings.decode import DecodeConfig, EngineConfig

    decode_names = {f.name for f in dataclasses.fields(DecodeConfig)} | {"preset"}
    engine_names = {f.name for f in dataclasses.fields(EngineConfig)} - {"device"}
    unknown = sorted(set(args) - decode_names - engine_names)
    if unknown:
        from ..errors import ConfigError

        raise ConfigError(
            f"unknown model_args {', '.join(unknown)}; accepted: pretrained, batch_size, max_length, device, "
            f"dtype, quantize, protocol, {', '.join(sorted(decode_names | engine_names))}"
        )
    engine = {k: v for k, v in args.items() if k in engine_names and v is not None}
    engine.setdefault("max_batch_size", batch_size)
    return {k: v for k, v in args.items() if k in decode_names}, EngineConfig(**engine)


if __name__ == "__main__":
    main()
