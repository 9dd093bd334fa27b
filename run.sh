#!/usr/bin/env bash
# The project's main job: trains the byte-level MoE language model (`python -m train`). Sets up
# .venv on first use (scripts/venv.sh), then passes every argument on:
#   ./run.sh                      # tiny preset on 8 simulated CPU devices (EP = 8): a few minutes
#   ./run.sh --steps 100 --workdir runs/a && ./run.sh --steps 500 --workdir runs/a --resume
#   ./run.sh --preset small --data ~/my_texts
#   ./run.sh sample --workdir runs/tiny --prompt "def " --max-new-bytes 300
#   ./run.sh --help               # every flag; ./run.sh sample --help
# The MoE layer's own quickstart (one layer forward + backward, checked against the reference):
#   .venv/bin/python -m mok_jax --help
set -euo pipefail
cd "$(dirname "$0")"
source scripts/venv.sh ""
exec "$MOK_PY" -m train "$@"
