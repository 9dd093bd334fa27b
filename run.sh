#!/usr/bin/env bash
# The project's main job. Sets up .venv on first use, then runs the quickstart:
#   ./run.sh                      # the tiny preset, forward + backward, checked against the reference
#   ./run.sh --preset deepseek_v3 --tokens 512
#   ./run.sh --help
set -euo pipefail
cd "$(dirname "$0")"
source scripts/venv.sh ""
exec "$MOK_PY" -m mok_jax "$@"
