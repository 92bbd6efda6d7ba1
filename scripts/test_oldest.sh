#!/usr/bin/env bash
# The suite with the oldest test dependencies pyproject.toml allows (constraints/oldest-test.txt), in a fresh
# virtual environment of its own: the lower bounds of the `test` extra are what this run passed with.
#   bash scripts/test_oldest.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(mktemp -d "${TMPDIR:-/tmp}/adaptree-oldest.XXXXXX")
trap 'rm -rf "$VENV"' EXIT
python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
bash scripts/setup.sh --test
python3 -m pip install -q --disable-pip-version-check -c constraints/oldest-test.txt \
  $(grep -vE '^\s*(#|$)' constraints/oldest-test.txt)
python3 -m pip list --format=freeze | grep -iE '^(pytest|hypothesis|accelerate|openai)=='
python3 -m pytest "$@"
