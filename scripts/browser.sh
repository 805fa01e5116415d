#!/usr/bin/env bash
# Headless Chromium for the playground's browser tests (tests/serve/test_playground.py): Debian's
# `chromium` and `chromium-driver`, installed when missing and this runs as root or with
# password-less sudo. Otherwise it says so, and those tests skip with the reason.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
skip="the browser tests will be skipped (install Debian's chromium and chromium-driver to run them)"
if ! command -v apt-get >/dev/null; then
  echo "setup: no apt-get here: $skip" >&2
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
  as_root=""
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  as_root="sudo -n"
else
  echo "setup: not root and no password-less sudo: $skip" >&2
  exit 0
fi
install() {
  $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
}
echo "setup: installing chromium and chromium-driver (apt) for the browser tests" >&2
if ! install 2>/dev/null; then
  # a fresh machine's package lists may be missing or stale
  $as_root apt-get update -qq >/dev/null && install || echo "setup: apt-get could not install them: $skip" >&2
fi
