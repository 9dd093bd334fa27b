#!/usr/bin/env bash
# The project's test suite. Sets up .venv (with the test extra) on first use, then runs pytest on
# 2 workers; arguments go to pytest, e.g. ./test.sh tests/mok_jax -k routing.
#   ./test.sh         the fast tier: every test module, the tests marked slow deselected
#   ./test.sh --all   every test (CI's)
# The fast tier hands each worker whole modules (--dist loadfile), so that a module compiles its
# programs and makes its fixtures once; --all keeps pytest-xdist's default, which spreads the
# long modules' tests over both workers.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/venv.sh "test"
dist=(--dist loadfile)
for arg in "$@"; do
  if [ "$arg" = --all ]; then dist=(); fi
done
exec "$MOK_PY" -m pytest -n 2 "${dist[@]}" "$@"
