#!/usr/bin/env bash
# The README's test command: a fresh virtual environment, meshax with its test extras, the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e ".[test,digits]"
python -m pytest tests -q -p no:cacheprovider -n auto --dist worksteal "$@"
