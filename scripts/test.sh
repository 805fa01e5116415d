#!/usr/bin/env bash
# The whole test suite on a fresh machine: install with every extra the tests use, check the
# code with ruff (lint and format), import-linter (the layers) and mypy (the types), all
# configured in pyproject.toml, then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh "dev,gguf,train,serve,eval,plot,quant"
.venv/bin/ruff check refusion tests
.venv/bin/ruff format --check refusion tests
.venv/bin/lint-imports --no-cache
.venv/bin/mypy
exec .venv/bin/python -m pytest -q "$@"
