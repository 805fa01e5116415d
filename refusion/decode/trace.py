"""A decoding's events as the slot view draws them, and the self-contained HTML page that
replays one (`refusion generate --trace`): one cell per generated position, coloured by
the step that committed it and marked by its path (global verification, parallel
infilling, AR, MDM), with what each step planned, corrected and rejected.

The drawing code is one module, `static/slots.js` (with `static/slots.css`), inlined here
and served by the playground of `refusion serve`, so both draw alike."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from ..settings.decode import DecodeConfig
from .request import RequestOutput, TraceEvent

STATIC = Path(__file__).with_name("static")  # the drawing module, shipped as package data

_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>ReFusion decoding trace</title><link rel="icon" href="data:,">
<style>
body{font-family:system-ui,sans-serif;margin:2em;max-width:70em;color:#222}
pre.text{background:#f7f7f7;padding:1em;white-space:pre-wrap}
button{margin-right:.5em}
__CSS__
</style></head><body>
<h1>Decoding trace</h1>
<p>__CONFIG__</p>
<div id="legend"></div>
<div id="rows"></div>
<script>
__JS__
</script>
<script>
const DATA = __DATA__;
document.getElementById('legend').appendChild(SlotView.legend());
DATA.forEach((d, r) => {
  const box = document.createElement('div');
  box.innerHTML = '<h2>Prompt ' + (r + 1) + '</h2><pre class="text"></pre>' +
    '<button class="play">play</button><button class="back">&larr;</button>' +
    '<button class="fwd">&rarr;</button><span class="step"></span><div class="view"></div>' +
    '<h3>Output</h3><pre class="text out"></pre><p class="stats"></p>';
  box.querySelector('pre.text').textContent = d.prompt;
  box.querySelector('pre.out').textContent = d.text;
  box.querySelector('.stats').textContent = d.stats;
  document.getElementById('rows').appendChild(box);
  const view = new SlotView(box.querySelector('.view'), d.length, d.slot_size);
  const steps = d.events.length ? d.events[d.events.length - 1].step + 1 : 0;
  let k = steps, timer = null;
  const show = () => {
    view.replay(d.events, k);
    if (k >= steps) view.settle();
    box.querySelector('.step').textContent =
      'step ' + k + ' / ' + steps + (k > 0 ? ': ' + view.summary(k - 1) : '');
  };
  box.querySelector('.back').onclick = () => { k = Math.max(0, k - 1); show(); };
  box.querySelector('.fwd').onclick = () => { k = Math.min(steps, k + 1); show(); };
  box.querySelector('.play').onclick = () => {
    clearInterval(timer); k = 0; show();
    timer = setInterval(() => { k++; show(); if (k >= steps) clearInterval(timer); }, 400);
  };
  show();
});
</script></body></html>
"""


def token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token's own text (its id, without a tokenizer)."""
    if tokenizer is None:
        return [str(t) for t in ids]
    return [tokenizer.decode([t]) for t in ids]


def event_dicts(tokenizer: Any, events: list[TraceEvent]) -> list[dict[str, Any]]:
    """Events as the slot view (static/slots.js) reads them: step, nfe, path, spans, and
    each span's token texts."""
    return [
        {
            "step": ev.step,
            "nfe": ev.nfe,
            "path": ev.path,
            "spans": [list(s) for s in ev.spans],
            "texts": [token_texts(tokenizer, toks) for toks in ev.tokens],
        }
        for ev in events
    ]


def trace_payload(
    tokenizer: Any, prompts: list[Any], outs: list[RequestOutput], slot_size: int = 1
) -> list[dict[str, Any]]:
    """The data the page replays: per prompt, its region, slot size, events and stats."""
    rows = []
    for prompt, out in zip(prompts, outs):
        events = out.trace or []
        width = max([s + n for ev in events for s, n in ev.spans] + [len(out.token_ids)])
        rows.append(
            {
                "prompt": prompt if isinstance(prompt, str) else " ".join(map(str, prompt)),
                "text": out.text if tokenizer is not None else " ".join(map(str, out.token_ids)),
                "length": width,
                "slot_size": slot_size,
                "events": event_dicts(tokenizer, events),
                "stats": (
                    f"tokens {out.stats.tokens}, NFE {out.stats.nfe}, TPF {out.stats.tpf:.2f}, "
                    f"{out.stats.wall_time:.3f} s, {out.stats.tps:.1f} tokens/s, finish: {out.finish_reason}"
                ),
            }
        )
    return rows


def script_json(value: Any) -> str:
    """`value` as JSON safe to embed in a <script> element whatever text it holds: `<`,
    `>` and `&` written as JSON escapes, so no `</script>`, `<!--` or `<script` in a prompt
    or an output can end the element or switch the HTML parser into its script-escape
    states (where the rest of the page is swallowed). JSON has these characters only
    inside strings, where the escapes mean the same; json.dumps writes every non-ASCII
    character (U+2028, which older JavaScript took for a line end, among them) as one."""
    text = json.dumps(value)
    for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):
        text = text.replace(char, escape)
    return text


def static_text(name: str) -> str:
    """A file of the drawing module (`slots.js`, `slots.css`)."""
    return (STATIC / name).read_text(encoding="utf-8")


def write_trace_html(
    path: str | Path, tokenizer: Any, prompts: list[Any], outs: list[RequestOutput], cfg: DecodeConfig
) -> Path:
    """Write the replay page; needs outputs generated with `trace=True` (commits only) or
    `trace="steps"` (also what each step planned, corrected and rejected)."""
    slot_size = cfg.slot_size if cfg.method == "refusion" else 1
    data = script_json(trace_payload(tokenizer, prompts, outs, slot_size))
    conf = html.escape(
        f"method {cfg.method}, gen_length {cfg.gen_length}, slot_size {cfg.slot_size}, "
        f"serial_blocks {cfg.serial_blocks}, slot_threshold {cfg.slot_threshold}, "
        f"token_threshold {cfg.token_threshold}, temperature {cfg.temperature}"
    )
    page = (
        _PAGE.replace("__CSS__", static_text("slots.css"))
        .replace("__JS__", static_text("slots.js").replace("</", "<\\/"))
        .replace("__CONFIG__", conf)
        .replace("__DATA__", data)
    )
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path
