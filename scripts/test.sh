#!/usr/bin/env bash
# The README's test command: a fresh virtual environment, meshax with its test, lint and docs
# extras; the lint, format and type checks and the docs build (each fails on any finding); the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e ".[test,digits,dev,docs]"
ruff check meshax tests benchmarks examples docs
ruff format --check meshax tests benchmarks examples docs README.md
mypy
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
# one run of both tiers (the default and the end-to-end tests marked slow), the slow ones first
python -m pytest tests -q -p no:cacheprovider -n auto --dist worksteal -m "slow or not slow" "$@"
