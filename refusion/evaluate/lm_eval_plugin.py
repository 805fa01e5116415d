"""lm-evaluation-harness model `refusion`: any lm-eval task on a ReFusion model.

- generate_until: `refusion.generate` with a DecodeConfig (a preset, then the request's
  max_gen_toks / temperature), cut at the request's stop strings. lm-eval has already
  formatted the context (and applied the chat template with --apply_chat_template), so we
  generate with chat=False.
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
        gen_length: int | None = None,
        batch_size: int | str = 1,
        max_length: int | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        model: Any = None,
        tokenizer: Any = None,
        generate_fn: Callable | None = None,
        **decode_overrides: Any,
    ) -> None:
        super().__init__()
        if model is None:
            import refusion

            model, tokenizer = refusion.load(pretrained, device=device, dtype=dtype)
        self.model, self.tokenizer = model.eval(), tokenizer
        self.pretrained = pretrained
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 1  # "auto" -> 1
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 2048
        self.max_length = min(int(max_length), limit) if max_length else limit
        self._generate_fn = generate_fn
        self._decode = {"method": method, "preset": preset, "gen_length": gen_length, **decode_overrides}

    # ------------------------------------------------------------------- tokenisation
    @property
    def tokenizer_name(self) -> str:
        return str(self.pretrained or "refusion-bundled").replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if isinstance(chat_template, str):
            return chat_template
        return getattr(self.tokenizer, "chat_template", None) or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

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
        import refusion

        d = self._decode
        cfg = refusion.DecodeConfig.preset(d["preset"]) if d.get("preset") else refusion.DecodeConfig()
        fields = {f.name for f in dataclasses.fields(cfg)}
        overrides = {k: v for k, v in d.items() if k in fields and v is not None}
        if gen_kwargs.get("do_sample") is False:
            overrides["temperature"] = 0.0
        elif gen_kwargs.get("temperature") is not None:
            overrides["temperature"] = float(gen_kwargs["temperature"])
        cfg = dataclasses.replace(cfg, **overrides)
        if gen_kwargs.get("max_gen_toks") and d.get("gen_length") is None:
            n = int(gen_kwargs["max_gen_toks"])
            if cfg.method == "refusion":  # whole slots in whole blocks; outputs are cut back to n
                unit = cfg.slot_size * cfg.serial_blocks
                n = -(-n // unit) * unit
            cfg = dataclasses.replace(cfg, gen_length=n)
        return cfg

    def _text(self, out: Any, max_tokens: int | None) -> str:
        if isinstance(out, str):
            return out
        ids = getattr(out, "token_ids", None)
        if max_tokens and ids is not None and len(ids) > max_tokens:
            return self.tokenizer.decode(list(ids)[:max_tokens], skip_special_tokens=True)
        return out.text

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from tqdm.auto import tqdm

        generate = self._generate_fn
        if generate is None:
            import refusion

            generate = refusion.generate
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(i)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generate_until")
        for indices in groups.values():
            gen_kwargs = dict(requests[indices[0]].args[1])
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            cfg = self._config(gen_kwargs)
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start : start + self.batch_size]
                contexts = [requests[i].args[0] for i in chunk]
                outputs = generate(self.model, self.tokenizer, contexts, cfg, chat=False)
                for i, context, out in zip(chunk, contexts, outputs):
                    text = self._text(out, gen_kwargs.get("max_gen_toks"))
                    for stop in until:
                        if stop:
                            text = text.split(stop)[0]
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", (context, requests[i].args[1]), text)
                bar.update(len(chunk))
        bar.close()
        return results  # type: ignore[return-value]

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
            windows = [(tokens[i : i + 1], tokens[i + 1 : i + 1 + step]) for i in range(0, len(tokens) - 1, step)]
            total = sum(ll for ll, _ in self._score(windows, True))
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
            out.append(total)
        return out

    @torch.inference_mode()
    def _score(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool) -> list[tuple[float, bool]]:
        """(sum log p(continuation | context), continuation is the greedy one) per pair."""
        from tqdm.auto import tqdm

        results: list[tuple[float, bool] | None] = [None] * len(pairs)
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
        return results  # type: ignore[return-value]


def main() -> None:
    """lm-eval's own command line, with the `refusion` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
