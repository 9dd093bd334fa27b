"""Expert parallelism on 8 simulated CPU devices (and 72 in a subprocess): the sharded layer
equals the unsharded one, y and dx bit for bit on every mesh and exchange."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import pytest
from absl.testing import parameterized
from flax import nnx
from jax.sharding import PartitionSpec

import mok_jax
from mok_jax import MoEConfig, MoEOptions, compiler_options, make_mesh
from mok_jax.mesh import ShardingRules
from tests.mok_jax.cases import (
    SCALED_PRESETS,
    assert_close_results,
    assert_same_rows,
    num_gpus,
    random_inputs,
    with_impl,
)
from tests.mok_jax.test_layer import scatter_combiners

# f32 on CPU, small tiles: the layer's own numerics, fast to compile.
DSV3 = dataclasses.replace(SCALED_PRESETS["deepseek_v3"], dtype=jnp.float32, row_tile=8)
QWEN3 = dataclasses.replace(SCALED_PRESETS["qwen3_30b_a3b"], dtype=jnp.float32, row_tile=8)
NUM_TOKENS = 64  # 8 per device on 8 devices


def loss_and_outputs(x, params, cotangent, cfg: MoEConfig, mesh):
    y, aux = mok_jax.moe(x, params, cfg, mesh=mesh)
    return jnp.sum(y.astype(jnp.float32) * cotangent) + aux.loss, (y, aux)


def value_and_grads_fn():
    """A fresh jit of ((loss, (y, aux)), (dx, dparams)), compiled with the deterministic
    options; cfg and mesh are static."""
    return jax.jit(
        jax.value_and_grad(loss_and_outputs, argnums=(0, 1), has_aux=True),
        static_argnums=(3, 4),
        compiler_options=compiler_options(),
    )


value_and_grads = value_and_grads_fn()


def lowered_for_cuda(x, params, cotangent, cfg: MoEConfig, mesh) -> str:
    """The StableHLO text of the forward+backward, lowered for CUDA on this CPU machine."""
    step = jax.jit(
        jax.value_and_grad(loss_and_outputs, argnums=(0, 1), has_aux=True), static_argnums=(3, 4)
    )
    return step.trace(x, params, cotangent, cfg, mesh).lower(lowering_platforms=("cuda",)).as_text()


def steer(params, bias: dict[int, float]):
    """Pushes the routing towards (or away from) experts through the selection bias."""
    for expert, value in bias.items():
        params = dataclasses.replace(params, router_bias=params.router_bias.at[expert].set(value))
    return params


def mesh_of(layout: str, **kw) -> jax.sharding.Mesh:
    devices = jax.devices()[: kw.pop("num_devices", len(jax.devices()))]
    return make_mesh(layout, devices=devices, **kw)


MESHES = {
    "ep2": dict(layout="expert", num_devices=2),
    "ep4": dict(layout="expert", num_devices=4),
    "ep8": dict(layout="expert"),
    "dp2xep4": dict(layout="data_expert", data=2),
    "dp4xep2": dict(layout="data_expert", data=4),
}

# Every mesh with each exchange; the fast tier runs one of them, both axes of the mesh in use.
CASES = [(mesh, exchange) for mesh in MESHES for exchange in ("ragged_all_to_all", "ring")]
FAST_CASE = ("dp2xep4", "ragged_all_to_all")


class ExpertParallelTest(parameterized.TestCase):
    def assert_sharded_matches(self, cfg, mesh, bias=None, num_tokens=NUM_TOKENS, seed=0):
        """Sharded vs unsharded: y and dx bitwise, counts exactly, the rest to tolerance; both
        against the reference to tolerance. Returns the sharded aux."""
        x, params, cotangent = random_inputs(cfg, num_tokens, seed)
        params = steer(params, bias or {})
        sharded = value_and_grads(x, params, cotangent, cfg, mesh)
        assert_same_rows(sharded, value_and_grads(x, params, cotangent, cfg, None), cfg.dtype)
        reference = with_impl(cfg, "reference")
        assert_close_results(
            sharded, value_and_grads(x, params, cotangent, reference, None), cfg.dtype
        )
        return sharded[0][1][1]

    def assert_sharded_equals_unsharded(self, mesh_name, exchange):
        cfg = dataclasses.replace(DSV3, exchange=exchange)
        aux = self.assert_sharded_matches(cfg, mesh_of(**MESHES[mesh_name]))
        self.assertEqual(int(aux.rounds), 1)

    def test_sharded_equals_unsharded(self):
        self.assert_sharded_equals_unsharded(*FAST_CASE)

    @parameterized.parameters(*(case for case in CASES if case != FAST_CASE))
    @pytest.mark.slow
    def test_sharded_equals_unsharded_on_more_meshes(self, mesh_name, exchange):
        self.assert_sharded_equals_unsharded(mesh_name, exchange)

    @parameterized.parameters("ragged_all_to_all", "ring")
    @pytest.mark.slow
    def test_other_preset_two_tokens_per_device(self, exchange):
        cfg = dataclasses.replace(QWEN3, exchange=exchange)
        self.assert_sharded_matches(cfg, mesh_of("expert"), num_tokens=16, seed=3)

    @parameterized.parameters("ragged_all_to_all", "ring")
    @pytest.mark.slow
    def test_forced_imbalance_takes_rounds_and_drops_nothing(self, exchange):
        # Every token to expert 0 (and its k-1 neighbours in the best group); experts of half
        # the devices get nothing. A buffer of a quarter of the balanced load needs rounds.
        cfg = dataclasses.replace(QWEN3, exchange=exchange, buffer_factor=0.25)
        bias = {e: 10.0 - e for e in range(cfg.top_k)} | {e: -10.0 for e in range(16, 32)}
        aux = self.assert_sharded_matches(cfg, mesh_of("expert"), bias=bias)
        self.assertGreater(int(aux.rounds), 1)
        self.assertEqual(int(aux.dropped), 0)
        self.assertEqual(int(jnp.sum(aux.tokens_per_expert[16:])), 0)

    @pytest.mark.slow
    def test_another_token_chunk_keeps_sharded_equal_to_unsharded(self):
        # token_chunk 16 (the default here is 8 * row_tile = 64): the route, combine and shared
        # expert run 4 chunks of the 64 tokens unsharded, 2 (8 tokens, padded) per device on 8
        # devices; the chunk's shape, not the count, fixes the bits (tiles.token_tiled).
        cfg = dataclasses.replace(DSV3, options=MoEOptions(token_chunk=16))
        self.assert_sharded_matches(cfg, mesh_of("expert"))

    @pytest.mark.slow
    def test_capacity_drops_like_unsharded(self):
        cfg = dataclasses.replace(QWEN3, capacity_factor=1.0)
        bias = {0: 1.0, 1: 1.0}  # overload two experts so the capacity bites
        aux = self.assert_sharded_matches(cfg, mesh_of("data_expert", data=2), bias=bias)
        self.assertGreater(int(aux.dropped), 0)

    @pytest.mark.slow
    def test_weight_gradients_bitwise_across_runs(self):
        cfg = dataclasses.replace(DSV3, exchange="ring")
        mesh = mesh_of("data_expert", data=2)
        x, params, cotangent = random_inputs(cfg, NUM_TOKENS, 5)
        first = value_and_grads_fn()(x, params, cotangent, cfg, mesh)
        second = value_and_grads_fn()(x, params, cotangent, cfg, mesh)
        chex.assert_trees_all_equal(first, second)

    @pytest.mark.slow
    def test_expert_weight_gradients_bitwise_across_expert_parallel_degrees(self):
        # One round of the windowed exchange: an expert's rows arrive whole, in global token
        # order, so its tiles (and their in-order accumulation) are the same on every mesh.
        x, params, cotangent = random_inputs(DSV3, NUM_TOKENS, 7)
        _, (_, dp1) = value_and_grads(x, params, cotangent, DSV3, None)
        for name in ("ep2", "ep4", "ep8"):
            _, (_, dp) = value_and_grads(x, params, cotangent, DSV3, mesh_of(**MESHES[name]))
            chex.assert_trees_all_equal(
                (dp.w_gate, dp.w_up, dp.w_down), (dp1.w_gate, dp1.w_up, dp1.w_down)
            )

    @pytest.mark.slow
    def test_shared_expert_weight_gradients_add_up_in_f32(self):
        # bf16 compute: each device's chunks add their weight gradients in f32 before the sum
        # over devices, so EP 8 differs from one device by f32 rounding only (rounding each
        # chunk's part to bf16 first differed by ~2^-9, as seen on two H200s).
        cfg = dataclasses.replace(SCALED_PRESETS["deepseek_v3"], row_tile=8)
        x, params, cotangent = random_inputs(cfg, NUM_TOKENS, 9)
        _, (_, dp1) = value_and_grads(x, params, cotangent, cfg, None)
        _, (_, dp) = value_and_grads(x, params, cotangent, cfg, mesh_of("expert"))
        for name in ("shared_w_gate", "shared_w_up", "shared_w_down"):
            got, want = getattr(dp, name), getattr(dp1, name)
            self.assertEqual(got.dtype, jnp.float32)
            error = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            self.assertLess(error, 1e-5, name)

    @pytest.mark.slow
    def test_module_under_set_mesh(self):
        model = mok_jax.MoE(DSV3, rngs=nnx.Rngs(0))
        specs = nnx.get_partition_spec(nnx.state(model))
        self.assertEqual(
            tuple(specs["w_gate"].get_metadata()["out_sharding"]), ("expert", None, None)
        )
        self.assertEqual(tuple(specs["router"].get_metadata()["out_sharding"]), (None, None))
        x = random_inputs(DSV3, NUM_TOKENS, 1)[0].reshape(4, 16, -1)
        y1, _ = model(x)
        mesh = mesh_of("data_expert", data=2)
        with jax.set_mesh(mesh):
            y, aux = jax.jit(lambda m, x: m(x))(model, x)
            placed = mok_jax.MoE(DSV3, rngs=nnx.Rngs(0))  # created under the mesh: placed on it
        chex.assert_trees_all_equal(y, y1)
        self.assertEqual(int(aux.rounds), 1)
        self.assertEqual(placed.w_down[...].sharding.spec, PartitionSpec("expert", None, None))
        chex.assert_trees_all_equal(placed.w_down[...], model.w_down[...])

    @pytest.mark.slow
    def test_no_host_synchronization(self):
        mesh = mesh_of("expert")
        x, params, cotangent = random_inputs(DSV3, NUM_TOKENS, 2)
        x = mok_jax.mesh.shard_tokens(x, mesh)
        cotangent = mok_jax.mesh.shard_tokens(cotangent, mesh)
        params = mok_jax.mesh.shard_params(params, mesh)
        step = value_and_grads_fn()
        jax.block_until_ready(step(x, params, cotangent, DSV3, mesh))  # compile outside
        with jax.transfer_guard("disallow"):
            jax.block_until_ready(step(x, params, cotangent, DSV3, mesh))

    def test_lowered_for_cuda(self):
        self.assert_lowered_for_cuda("ragged_all_to_all", "ragged_all_to_all")

    @pytest.mark.slow
    def test_lowered_for_cuda_with_the_ring(self):
        self.assert_lowered_for_cuda("ring", "collective_permute")

    def assert_lowered_for_cuda(self, exchange, collective):
        cfg = dataclasses.replace(DSV3, exchange=exchange, dtype=jnp.bfloat16, row_tile=64)
        mesh = mesh_of("expert")
        x, params, cotangent = random_inputs(cfg, 8 * 64, 0)
        text = lowered_for_cuda(x, params, cotangent, cfg, mesh)
        self.assertIn(collective, text)
        self.assertIn("all_gather", text)  # the per-expert counts
        for combiner in scatter_combiners(text):
            self.assertNotIn("add", combiner)

    @pytest.mark.slow
    def test_one_device_mesh_needs_no_collective(self):
        mesh = mesh_of("expert", num_devices=1)
        self.assert_sharded_matches(DSV3, mesh)
        x, params, cotangent = random_inputs(DSV3, NUM_TOKENS, 0)
        text = lowered_for_cuda(x, params, cotangent, DSV3, mesh)
        self.assertNotIn("ragged_all_to_all", text)

    def test_bad_meshes_and_shapes(self):
        x, params, _ = random_inputs(DSV3, NUM_TOKENS, 0)
        no_expert_axis = jax.make_mesh((8,), ("data",))
        with self.assertRaisesRegex(ValueError, "'expert'"):
            mok_jax.moe(x, params, DSV3, mesh=no_expert_axis)
        cfg_e12 = dataclasses.replace(DSV3, num_experts=12, num_groups=None, topk_groups=None)
        x12, params12, _ = random_inputs(cfg_e12, NUM_TOKENS, 0)
        with self.assertRaisesRegex(ValueError, "num_experts=12 .* 8"):
            mok_jax.moe(x12, params12, cfg_e12, mesh=mesh_of("expert"))
        with self.assertRaisesRegex(ValueError, "60 tokens .* 8 devices"):
            mok_jax.moe(x[:60], params, DSV3, mesh=mesh_of("expert"))
        with self.assertRaisesRegex(ValueError, "must include the expert axis"):
            ShardingRules(tokens=("data",))

    def test_make_mesh_layouts(self):
        self.assertEqual(dict(make_mesh().shape), {"data": 1, "expert": 8})
        self.assertEqual(dict(make_mesh(expert=4).shape), {"data": 1, "expert": 4})
        self.assertEqual(dict(make_mesh("data_expert", data=2).shape), {"data": 2, "expert": 4})
        self.assertEqual(dict(make_mesh("data_expert", expert=2).shape), {"data": 4, "expert": 2})
        for layout in ("nvl72", "nvl72_ep72", "mok_ep64"):
            with self.assertRaisesRegex(ValueError, "devices"):
                make_mesh(layout)
        with self.assertRaisesRegex(ValueError, "layout="):
            make_mesh("torus")
        with self.assertRaisesRegex(ValueError, "data=3 must divide the 8 devices"):
            make_mesh("data_expert", data=3)
        with self.assertRaisesRegex(ValueError, "expert=3 must divide the 8 devices"):
            make_mesh("data_expert", expert=3)

    @pytest.mark.slow
    def test_rules_place_inputs_of_any_sharding(self):
        mesh = mesh_of("data_expert", data=2)
        x, params, _ = random_inputs(DSV3, NUM_TOKENS, 4)
        odd = jax.device_put(x, jax.NamedSharding(mesh, PartitionSpec(None, "expert")))
        y1, _ = mok_jax.moe(x, params, DSV3)
        y, _ = mok_jax.moe(odd, params, DSV3, mesh=mesh)
        chex.assert_trees_all_equal(y, y1)
        self.assertEqual(y.sharding.spec, PartitionSpec(("data", "expert"), None))


RACK_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=72"
    import dataclasses, jax, jax.numpy as jnp, numpy as np
    import mok_jax
    from tests.mok_jax.test_expert_parallel import value_and_grads
    from tests.mok_jax.cases import random_inputs
    base = dataclasses.replace(mok_jax.presets["mok_bench"], dtype=jnp.float32, row_tile=8)
    for layout, experts in (("nvl72", 32), ("nvl72_ep72", 144), ("mok_ep64", 128)):
        cfg = mok_jax.scale_down(base, max_experts=experts)
        mesh = mok_jax.make_mesh(layout)
        x, params, ct = random_inputs(cfg, 2 * mesh.size, 0)
        (_, (y1, a1)), (dx1, dp1) = value_and_grads(x, params, ct, cfg, None)
        (_, (y, a)), (dx, dp) = value_and_grads(x, params, ct, cfg, mesh)
        same = bool(jnp.array_equal(y, y1)) and bool(jnp.array_equal(dx, dx1))
        counts = bool(jnp.array_equal(a.tokens_per_expert, a1.tokens_per_expert))
        err = max(float(jnp.max(jnp.abs(u - v)) / (jnp.max(jnp.abs(v)) + 1e-30))
                  for u, v in zip(jax.tree.leaves(dp), jax.tree.leaves(dp1)))
        print(layout, dict(mesh.shape), cfg.num_experts, same, counts, err, int(a.rounds))
    """
)


@pytest.mark.slow
def test_rack_layouts_on_72_devices():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-c", RACK_SCRIPT], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if re.match(r"(nvl72|mok_ep64)", line)]
    assert len(lines) == 3, result.stdout
    for line in lines:
        layout, *_, same, counts, err, rounds = line.split()
        assert same == "True", f"{layout}: y or dx differ from unsharded: {line}"
        assert counts == "True", line
        assert float(err) < 1e-5, f"{layout}: weight gradients off by {err}: {line}"
        assert int(rounds) >= 1, line


@pytest.mark.gpu
@pytest.mark.skipif(num_gpus() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("exchange", ["ragged_all_to_all", "ring"])
def test_gpu_two_devices_equal_one(implementation, exchange):
    """Real GPUs, real size: EP = 2 against one GPU, y and dx the same bits, the rest to the
    bf16 tolerance, the same bits on a second run; 'pallas' (the Mosaic GPU kernels) also
    against 'xla' on EP = 2, to tolerance."""
    cfg = with_impl(mok_jax.presets["qwen3_30b_a3b"], implementation, exchange=exchange)
    x, params, cotangent = random_inputs(cfg, 4096, seed=11)
    one = make_mesh("expert", devices=jax.devices("gpu")[:1])
    two = make_mesh("expert", devices=jax.devices("gpu")[:2])
    first = value_and_grads(x, params, cotangent, cfg, two)
    chex.assert_trees_all_equal(first, value_and_grads_fn()(x, params, cotangent, cfg, two))
    assert_same_rows(first, value_and_grads(x, params, cotangent, cfg, one), cfg.dtype)
    if implementation == "pallas":
        xla = with_impl(cfg, "xla")
        assert_close_results(first, value_and_grads(x, params, cotangent, xla, two), cfg.dtype)
