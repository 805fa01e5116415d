"""A self-contained HTML page that replays the order in which slots were filled (the
paper's animation): one cell per generated position, coloured by the path that committed
it (fast verification, parallel infilling, AR, MDM), step by step; a cell's tooltip says
how its token was accepted (`request.HOW`) and whether its left context was final."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from .config import DecodeConfig
from .request import RequestOutput

_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>ReFusion decoding trace</title>
<style>
body{font-family:system-ui,sans-serif;margin:2em;max-width:70em;color:#222}
.grid{display:flex;flex-wrap:wrap;gap:2px;margin:.5em 0 1em}
.cell{font-family:ui-monospace,monospace;font-size:12px;min-width:1.6em;padding:2px 3px;border-radius:3px;
  background:#eee;color:#999;white-space:pre}
.fast{background:#b7e4c7;color:#123}.infill{background:#a9c9f5;color:#123}.ar{background:#ddd;color:#123}.mdm{background:#f6c99b;color:#123}
.new{outline:2px solid #d00}
.legend span{margin-right:1em;padding:2px 6px;border-radius:3px}
pre.text{background:#f7f7f7;padding:1em;white-space:pre-wrap}
button{margin-right:.5em}
</style></head><body>
<h1>Decoding trace</h1>
<p>__CONFIG__</p>
<p class="legend"><span class="fast">fast path (global verification)</span><span
  class="infill">parallel AR infilling</span><span class="ar">AR</span><span class="mdm">MDM</span>
  the red outline marks the latest commit.</p>
<div id="rows"></div>
<script>
const DATA = __DATA__;
function render(r, upto) {
  const d = DATA[r], cells = d.tokens.map(() => null), how = d.tokens.map(() => ''), newest = new Set();
  for (let k = 0; k < upto && k < d.events.length; k++) {
    const ev = d.events[k];
    ev.spans.forEach(([s, n], j) => {
      for (let i = s; i < s + n; i++) {
        cells[i] = ev.path; if (k === upto - 1) newest.add(i);
        how[i] = ', ' + ev.how[j][i - s] + (ev.exact[j] ? '' : ', left context not final');
      }
    });
  }
  const grid = document.getElementById('grid' + r);
  grid.innerHTML = '';
  d.tokens.forEach((t, i) => {
    const c = document.createElement('span');
    c.className = 'cell' + (cells[i] ? ' ' + cells[i] : '') + (newest.has(i) ? ' new' : '');
    c.textContent = cells[i] ? t : '\\u00b7';
    c.title = 'position +' + i + how[i];
    grid.appendChild(c);
  });
  document.getElementById('step' + r).textContent =
    'commit ' + Math.min(upto, d.events.length) + ' / ' + d.events.length;
}
DATA.forEach((d, r) => {
  const box = document.createElement('div');
  box.innerHTML = '<h2>Prompt ' + (r + 1) + '</h2><pre class="text"></pre>' +
    '<button id="play' + r + '">play</button><button id="back' + r + '">&larr;</button>' +
    '<button id="fwd' + r + '">&rarr;</button>' +
    '<span id="step' + r + '"></span><div class="grid" id="grid' + r + '"></div>' +
    '<h3>Output</h3><pre class="text out"></pre>' +
    '<p>' + d.stats + '</p>';
  box.querySelector('pre.text').textContent = d.prompt;
  box.querySelector('pre.out').textContent = d.text;
  document.getElementById('rows').appendChild(box);
  let k = d.events.length, timer = null;
  const show = () => render(r, k);
  document.getElementById('back' + r).onclick = () => { k = Math.max(0, k - 1); show(); };
  document.getElementById('fwd' + r).onclick = () => { k = Math.min(d.events.length, k + 1); show(); };
  document.getElementById('play' + r).onclick = () => {
    clearInterval(timer); k = 0; show();
    timer = setInterval(() => { k++; show(); if (k >= d.events.length) clearInterval(timer); }, 400);
  };
  show();
});
</script></body></html>
"""


def _token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    if tokenizer is None:
        return [str(t) for t in ids]
    return [tokenizer.decode([t]) or repr(t) for t in ids]


def trace_payload(tokenizer: Any, prompts: list[Any], outs: list[RequestOutput]) -> list[dict[str, Any]]:
    """The data the page replays: per prompt, the committed tokens by position and the events."""
    rows = []
    for prompt, out in zip(prompts, outs):
        events = out.trace or []
        width = max([s + n for ev in events for s, n in ev.spans] + [len(out.token_ids)])
        ids: list[int | None] = [None] * width
        for ev in events:
            for (s, _), toks in zip(ev.spans, ev.tokens):
                ids[s : s + len(toks)] = toks
        texts = _token_texts(tokenizer, [t for t in ids if t is not None])
        it = iter(texts)
        rows.append(
            {
                "prompt": prompt if isinstance(prompt, str) else " ".join(map(str, prompt)),
                "text": out.text if tokenizer is not None else " ".join(map(str, out.token_ids)),
                "tokens": [next(it) if t is not None else "" for t in ids],
                "events": [
                    {"path": ev.path, "spans": ev.spans, "how": ev.how, "exact": ev.exact} for ev in events
                ],
                "stats": html.escape(
                    f"tokens {out.stats.tokens}, NFE {out.stats.nfe}, TPF {out.stats.tpf:.2f}, "
                    f"{out.stats.wall_time:.3f} s, {out.stats.tps:.1f} tokens/s, finish: {out.finish_reason}"
                ),
            }
        )
    return rows


def write_trace_html(
    path: str | Path, tokenizer: Any, prompts: list[Any], outs: list[RequestOutput], cfg: DecodeConfig
) -> Path:
    """Write the replay page; needs outputs generated with `trace=True`."""
    data = json.dumps(trace_payload(tokenizer, prompts, outs)).replace("</", "<\\/")
    conf = html.escape(
        f"method {cfg.method}, gen_length {cfg.gen_length}, slot_size {cfg.slot_size}, "
        f"serial_blocks {cfg.serial_blocks}, slot_threshold {cfg.slot_threshold}, "
        f"token_threshold {cfg.token_threshold}, temperature {cfg.temperature}"
    )
    path = Path(path)
    path.write_text(_PAGE.replace("__DATA__", data).replace("__CONFIG__", conf), encoding="utf-8")
    return path
