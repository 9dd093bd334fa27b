"""How well-conditioned is the forward+backward check's scalar loss = sum(y * cot) at dsv3_slice?

    PYTHONPATH=. python3 bench/results/2026-12-01_moe_layer_h200/loss_conditioning.py

The benchmark's own inputs (bench.moe_layer.make_inputs, same seeds), y from
implementation "xla" on the CPU (~35 s), then the loss in f64, its natural scale, and the loss
after moving two fifths of y's entries by |y| 2^-8 (half to one bf16 ulp; random sign).
Output: loss_conditioning.log.
"""

import jax
import jax.numpy as jnp
import numpy as np

from bench import moe_layer as b
from mok_jax import moe

shape = next(s for s in b.SHAPES if s.name == "dsv3_slice")
inp = b.make_inputs(shape, None)
y = jax.jit(lambda x, p: moe(x, p, inp.cfg)[0])(inp.x, inp.params)
y = np.asarray(y.astype(jnp.float32), np.float64)
c = np.asarray(inp.cot.astype(jnp.float32), np.float64)
terms = y * c
print("loss f64", terms.sum(), "sum|terms|", np.abs(terms).sum())
print("sqrt(sum terms^2)", np.sqrt((terms**2).sum()), "rms y", np.sqrt((y**2).mean()), "N", y.size)
rng = np.random.default_rng(0)
ulp = np.abs(y) * 2.0**-8
for _ in range(3):
    moved = y + ulp * rng.choice([-1, 0, 0, 0, 1], size=y.shape)
    print("loss with two fifths of y moved by |y| 2^-8:", (moved * c).sum())
