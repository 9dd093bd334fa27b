"""`python -m mok_jax`: the quickstart (see mok_jax/quickstart.py)."""

import sys

from mok_jax.quickstart import main

sys.exit(main())
