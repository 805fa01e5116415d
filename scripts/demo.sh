#!/usr/bin/env bash
# The main job on a fresh machine: install, then generate with the bundled model and print stats.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
prompt="${1:-Sort these numbers from smallest to largest: 42, 7, 19, 3, 25}"
.venv/bin/refusion generate "$prompt" --stats
