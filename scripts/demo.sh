#!/usr/bin/env bash
# The main job on a fresh machine: install, then generate with the bundled model and print stats.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
prompt="${1:-Write these words in capital letters: leaf, frog, coin, star}"
.venv/bin/refusion generate "$prompt" --gen-length 128 --slot-size 8 --serial-blocks 4 --slot-threshold 0.7 --token-threshold 0.3 --stats
