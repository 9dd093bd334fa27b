"""Diagnostic (session 10, after the hang): mosaic_gpu.dispatch's copy path alone (steps 1-2
without the semaphore signal and without block 0's waits) under Mosaic GPU's interpret mode on
the CPU, one device, the small case of the GPU test (3 local experts, 200 rows, window 96, tile
8, D 256, 4 blocks). It prints, per round, whether every filled slot is the protocol's row
(output: copies_interpret.log).

    PYTHONPATH=. python bench/results/2026-12-01_exchange_dispatch_h200/copies_interpret.py
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mok_jax import exchange
from mok_jax import exchange_protocol as xp
from tests.pallas_kernels.exchange.test_mosaic_gpu import planned_buffers, random_counts

NUM_LOCAL, NUM_ROWS, WINDOW, TILE, D_MODEL, BLOCKS, CHUNK = 3, 200, 96, 8, 256, 4, 128


def copies(x_ref, row_ref, slot_ref, size_ref, round_p_ref, count_ref, round_ref, buf_ref,
           stage_smem, loaded):  # fmt: skip
    """The kernel's step 1 as in mosaic_gpu._dispatch_kernel, local, without the signal."""
    block = lax.axis_index("blocks")

    @pl.loop(block, count_ref[0], step=BLOCKS)
    def _piece(p):
        @pl.when(round_p_ref[p] == round_ref[0])
        def _send():
            row, slot = row_ref[p], slot_ref[p]

            @pl.loop(0, size_ref[p])
            def _row(i):
                for c in range(D_MODEL // CHUNK):
                    cols = pl.ds(c * CHUNK, CHUNK)
                    plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(row + i, 1), cols], stage_smem, loaded)
                    plgpu.barrier_wait(loaded)
                    plgpu.copy_smem_to_gmem(stage_smem, buf_ref.at[pl.ds(slot + i, 1), cols])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            plgpu.wait_smem_to_gmem(0, wait_read_only=False)


def main() -> None:
    counts_se = random_counts(1, 1, NUM_LOCAL, NUM_ROWS)
    t = exchange.traffic(jnp.asarray(counts_se), NUM_LOCAL)
    slots = xp.num_tiles(WINDOW, TILE, NUM_LOCAL) * TILE
    x = jax.random.normal(jax.random.key(0), (NUM_ROWS, D_MODEL), jnp.float32)
    x = x.astype(jnp.bfloat16)
    want, filled, rounds = planned_buffers(counts_se, np.asarray(x)[None], NUM_LOCAL, WINDOW, TILE)
    p = xp.pieces(xp.row_places(t, jnp.int32(0), NUM_ROWS, WINDOW, TILE), TILE)
    run = plgpu.kernel(
        copies,
        out_type=jax.ShapeDtypeStruct((slots, D_MODEL), x.dtype),
        grid=(BLOCKS,),
        grid_names=("blocks",),
        scratch_types=[plgpu.SMEM((1, CHUNK), x.dtype), plgpu.Barrier(num_arrivals=1)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams(),
    )
    for r in range(rounds):
        out = run(x, p.row_p, p.slot_p, p.size_p, p.round_p, p.count.reshape(1),
                  jnp.int32(r).reshape(1))  # fmt: skip
        mask = filled[0, r]
        same = np.array_equal(np.asarray(out)[mask], want[0, r][mask])
        print(f"round {r}: every filled slot as planned: {same}")


if __name__ == "__main__":
    main()
