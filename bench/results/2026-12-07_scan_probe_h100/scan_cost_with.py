"""`python -m bench.scan_cost` with `mok_jax.compiler_options()` plus the XLA options that
scan_probe.py names (argv[1]): python scan_cost_with.py default|nodsf|nounroll ARGS..."""

import sys

from scan_probe import EXTRA, use_options

from bench import scan_cost

if __name__ == "__main__":
    use_options(sys.argv[1])
    print("extra options", EXTRA[sys.argv[1]], flush=True)
    scan_cost.main(sys.argv[2:])
