#!/usr/bin/env bash
# The main job on a fresh machine: install, then generate with the bundled model and print stats.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# the bundled model answers prompts of four kinds: `.venv/bin/refusion generate --examples` prints one of each;
# its decoding settings come from its decode_config.json
prompt="${1:-Write these words in capital letters: leaf, frog, coin, star}"
.venv/bin/refusion generate "$prompt" --stats
