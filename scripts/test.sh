#!/usr/bin/env bash
# The README's test command: a fresh virtual environment, meshax with its test and lint extras;
# the lint, format and type checks (each fails on any finding); the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e ".[test,digits,dev]"
ruff check meshax tests benchmarks examples
ruff format --check meshax tests benchmarks examples
mypy
python -m pytest tests -q -p no:cacheprovider -n auto --dist worksteal "$@"
