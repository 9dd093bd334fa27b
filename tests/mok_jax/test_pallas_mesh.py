"""implementation="pallas" under a mesh: the Mosaic GPU grouped GEMMs inside `jax.shard_map`.

On CPU the kernels run in GPU interpret mode (small shapes, few cases: it is slow) on 1 and 2
devices, with the ragged exchange only (the ring's extra kernels on 2 interpreted devices hit
jax 0.11.2's cross-device interpreter races more often; `gpu_interpret_on_several_devices`
works around the two we met), and the forward+backward is lowered for CUDA on larger meshes.
y and dx are the same bits as 'pallas' on one device: a row's result does not depend on the
tile count (every kernel tile is one dot of a fixed shape, and a row's K-loop does not depend
on its tile's neighbours); the rest is held to 'xla' under the same mesh to the bf16
tolerance.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

import chex
import jax
import jax.numpy as jnp
import pytest
from absl.testing import parameterized
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mok_jax
from mok_jax import make_mesh
from pallas_kernels.grouped_matmul import ops
from tests.mok_jax.cases import (
    SCALED_PRESETS,
    assert_close_results,
    assert_same_rows,
    random_inputs,
    with_impl,
)
from tests.mok_jax.test_expert_parallel import lowered_for_cuda, value_and_grads

# Small enough for interpret mode: 8 experts, top-2, 8-row tiles (D = F = 64).
QWEN3 = dataclasses.replace(
    SCALED_PRESETS["qwen3_30b_a3b"], implementation="pallas", num_experts=8, top_k=2, row_tile=8
)
NUM_TOKENS = 16
# A Mosaic GPU kernel call in StableHLO lowered for CUDA (jax 0.11.2: @mosaic_gpu_v2).
MOSAIC_GPU_CALL = re.compile(r"stablehlo\.custom_call @mosaic_gpu")


@contextlib.contextmanager
def gpu_interpret_on_several_devices():
    """Works around two races in jax 0.11.2's GPU interpret mode under a multi-device
    shard_map, both from process-wide state that assumes one device runs at a time:
    - at the end of a kernel each device checks that no barrier of ANY device is still
      allocated, while the other devices may still be running that kernel ("Barrier remains
      allocated ... device_id=1"): here each device first waits for all the others;
    - when a device finishes a cluster it resets the per-cluster state (the ids of wgmma
      accumulators among others) while another device may be inside its own cluster, which
      then frees an accumulator the reset forgot (a KeyError on HostAllocationKey
      memory_space_id=3, buffer_id=-100): here every device finishes its i-th cluster before
      any resets, and every reset is done before any device starts its next cluster.
    Both waits use the interpreter's own device barrier; every device runs the same kernels
    on the same grid, so each reaches them the same number of times. Nothing else changes."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    originals = (gpu_callbacks._assert_no_barriers_allocated, gpu_callbacks.cluster_finished)

    @gpu_callbacks.fail_on_exception
    def assert_after_every_device(token):
        shared_memory = gpu_callbacks._get_shared_memory()
        shared_memory.barrier.wait()
        shared_memory.assert_no_barriers_allocated()
        return token

    @gpu_callbacks.fail_on_exception
    def cluster_finished_in_step(*, token):
        shared_memory = gpu_callbacks._get_shared_memory()
        shared_memory.barrier.wait()
        shared_memory.reset_per_cluster_state()
        shared_memory.barrier.wait()
        return token

    gpu_callbacks._assert_no_barriers_allocated = assert_after_every_device
    gpu_callbacks.cluster_finished = cluster_finished_in_step
    try:
        yield
    finally:
        gpu_callbacks._assert_no_barriers_allocated, gpu_callbacks.cluster_finished = originals


def lowered_with_kernels(x, params, cotangent, cfg, mesh) -> str:
    """`lowered_for_cuda` with the kernels themselves: the layer runs them in GPU interpret
    mode when its target is a CPU, so here it is built for an H200."""
    with mok_jax.targeting("NVIDIA H200"):
        return lowered_for_cuda(x, params, cotangent, cfg, mesh)


def mesh_of(layout: str, num_devices: int, **kw) -> jax.sharding.Mesh:
    return make_mesh(layout, devices=jax.devices()[:num_devices], **kw)


@functools.cache
def one_device(cfg, seed):
    """'pallas' without a mesh: ((loss, (y, aux)), (dx, dparams)), computed once per case."""
    return value_and_grads(*random_inputs(cfg, NUM_TOKENS, seed), cfg, None)


class PallasMeshTest(parameterized.TestCase):
    def assert_pallas_mesh_matches(self, cfg, mesh, seed=0):
        """'pallas' on `mesh` against 'pallas' on one device (y and dx bitwise, counts exactly,
        the rest to tolerance) and against 'xla' on `mesh` (tolerance)."""
        x, params, cotangent = random_inputs(cfg, NUM_TOKENS, seed)
        sharded = value_and_grads(x, params, cotangent, cfg, mesh)
        assert_same_rows(sharded, one_device(cfg, seed), cfg.dtype)
        xla = with_impl(cfg, "xla")
        assert_close_results(sharded, value_and_grads(x, params, cotangent, xla, mesh), cfg.dtype)

    @pytest.mark.slow
    def test_two_devices_equal_one(self):
        """EP 2, then 2 devices on the data axis (the weights' gradients summed over it): one
        test, so that the one-device run is computed once."""
        with gpu_interpret_on_several_devices():
            self.assert_pallas_mesh_matches(QWEN3, mesh_of("expert", 2))
            self.assert_pallas_mesh_matches(QWEN3, mesh_of("data_expert", 2, data=2))

    def test_reference_still_refuses_a_mesh(self):
        cfg = with_impl(QWEN3, "reference")
        x, params, _ = random_inputs(cfg, NUM_TOKENS)
        with self.assertRaisesRegex(ValueError, "under a mesh use 'xla', 'pallas' or 'fused'"):
            mok_jax.moe(x, params, cfg, mesh=mesh_of("expert", 2))


# The ring on the 2 x 4 mesh (along the expert axis of a mesh of two axes, in four hops, three
# of them remote: what EP 2's two hops lower, more of it), the ragged exchange on a mesh of one
# axis and of two.
@pytest.mark.parametrize(
    "layout, exchange, collective",
    [
        ("dp2xep4", "ring", "collective_permute"),
        ("ep8", "ragged_all_to_all", "ragged_all_to_all"),
        ("dp2xep4", "ragged_all_to_all", "ragged_all_to_all"),
    ],
)
@pytest.mark.slow
def test_lowered_for_cuda(layout, exchange, collective):
    """The forward+backward lowers for CUDA with the kernels inside shard_map (each case lowers
    some twenty Mosaic GPU kernels, 40 s or more on 2 CPU cores)."""
    cfg = with_impl(SCALED_PRESETS["deepseek_v3"], "pallas", exchange=exchange)
    mesh = {
        "ep8": lambda: mesh_of("expert", 8),
        "dp2xep4": lambda: mesh_of("data_expert", 8, data=2),
    }[layout]()
    x, params, cotangent = random_inputs(cfg, 64, 0)
    text = lowered_with_kernels(x, params, cotangent, cfg, mesh)
    assert "sdy.manual_computation" in text
    # A round's forward: gate/up and down; its backward: gate and up recomputed, the d_lhs
    # gmms and the tgmms of both custom VJPs.
    assert len(MOSAIC_GPU_CALL.findall(text)) >= 8
    assert collective in text
    assert "all_gather" in text  # the per-expert counts
    assert "io_callback" not in text  # no interpret mode left


@pytest.mark.slow
def test_ops_inside_shard_map():
    """The custom VJPs inside shard_map: rows varying over the axis, weights, scales and group
    sizes not (their gradients summed over it); values and gradients the same bits as without
    shard_map (a 1-device mesh: interpret mode)."""
    m, d, f = 64, 64, 128
    keys = jax.random.split(jax.random.key(3), 6)

    def bf16(key, shape):
        return (jax.random.normal(key, shape, jnp.float32) * 0.3).astype(jnp.bfloat16)

    x = bf16(keys[0], (m, d))
    weights = (bf16(keys[1], (3, d, f)), bf16(keys[2], (3, d, f)), bf16(keys[3], (3, f, d)))
    scale = jax.random.uniform(keys[4], (m,), jnp.float32, 0.5, 1.5)
    cotangent = jax.random.normal(keys[5], (m, d), jnp.float32)
    sizes = jnp.asarray([20, 0, 37], jnp.int32)

    def loss(x, w_gate, w_up, w_down, scale, cotangent, sizes):
        h = ops.gmm_swiglu(x, w_gate, w_up, sizes, interpret=True)
        y = ops.gmm(h, w_down, sizes, row_scale_m=scale, interpret=True)
        return jnp.sum(y * cotangent)

    def sharded_loss(*args):
        return lax.psum(loss(*args), "rows")

    mesh = jax.make_mesh((1,), ("rows",), devices=jax.devices()[:1])
    specs = (P("rows"), P(), P(), P(), P(), P("rows"), P())
    sharded = jax.shard_map(sharded_loss, mesh=mesh, in_specs=specs, out_specs=P())
    args = (x, *weights, scale, cotangent, sizes)
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs, strict=True)]
    grad = functools.partial(jax.value_and_grad, argnums=(0, 1, 2, 3, 4))
    chex.assert_trees_all_equal(jax.jit(grad(sharded))(*placed), jax.jit(grad(loss))(*args))
