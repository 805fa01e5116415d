"""ReFusion decoding (docs/algorithm.md#decoding), read in this order:

- `row.py`: one request's row and the paper's steps (plan, select_slots, verify, commit);
- `infill.py`: step 4, parallel autoregressive infilling over forked cache rows;
- `rule.py`: the hooks where options beyond the paper change a step, composing
- `options.py`: each option its own class (ar_correction, first_token_check, left_check);
- `judge.py`: how verification judges a draft (the paper's threshold, or speculative
  sampling for sampled rows whose settings are lossless);
- `drafting.py`: how much a row drafts (widths the engine sets, AR blocks, the lossless
  first infilling round);
- `provenance.py`: tracing, an observer the steps report to.
"""

from __future__ import annotations

from .infill import Fork, Infill
from .row import Plan, ReFusionRow, select_slots

__all__ = ["Fork", "Infill", "Plan", "ReFusionRow", "select_slots"]
