"""`python -m bench.scan_cost` with `mok_jax.compiler_options()` plus the XLA options that
scan_probe.py names (argv[1]): python scan_cost_with.py default|nodsf|nounroll ARGS..."""

import sys

from scan_probe import EXTRA

import mok_jax
from bench import scan_cost

if __name__ == "__main__":
    base = mok_jax.compiler_options
    extra = EXTRA[sys.argv[1]]
    mok_jax.compiler_options = lambda: {**base(), **extra}
    print("extra options", extra, flush=True)
    scan_cost.main(sys.argv[2:])
