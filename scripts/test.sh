#!/usr/bin/env bash
# The whole test suite on a fresh machine: install with every extra the tests use, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh "dev,gguf,train,serve,eval,plot"
exec .venv/bin/python -m pytest -q "$@"
