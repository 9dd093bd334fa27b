"""The MoE layer's contract, held against the reference: one base class, `_LayerTest`, and one
thin subclass per implementation (`reference`, `xla`, `pallas`, `fused`), each with the tests
particular to it. The kernel implementations run their Mosaic GPU kernels in GPU interpret mode
on a CPU backend. A subclass names its tests of the fast tier; the others are marked slow."""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import re
import subprocess
import sys
import unittest
from unittest import mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from mok_jax import MoEConfig, init_params, moe, presets, resolve
from pallas_kernels.grouped_matmul import mosaic_gpu
from tests.mok_jax.cases import (
    SCALED_PRESETS,
    assert_aux_equal,
    assert_close,
    assert_close_results,
    jit_value_and_grads,
    loss_and_outputs,
    random_inputs,
    value_and_grads,
    with_impl,
)

TINY = presets["tiny"]
ROOT = pathlib.Path(__file__).resolve().parents[2]


def scatter_combiners(hlo_text: str) -> list[str]:
    """The ops in the combiner region of every `stablehlo.scatter` of a lowered module."""
    combiners = []
    for match in re.finditer(r'"?stablehlo\.scatter"?\(', hlo_text):
        region = hlo_text[match.end() :].split("})", 1)[0]
        combiners.append(" ".join(sorted(set(re.findall(r"stablehlo\.\w+", region)))))
    return combiners


def compiled_float_scatter_adds(hlo_text: str) -> list[str]:
    """Scatters of a compiled (optimized) HLO module that add floats: what XLA really runs."""
    blocks = re.split(r"\n(?=\S)", hlo_text)  # one computation per unindented header
    adds = {block.split()[0].lstrip("%") for block in blocks if re.search(r" add\(", block)}
    found = []
    for line in hlo_text.splitlines():
        match = re.search(r"= (\w+)\[[^=]*\bscatter\(.*to_apply=%([\w.\-]+)", line)
        if match and match.group(1).startswith(("f", "bf")) and match.group(2) in adds:
            found.append(line.strip()[:160])
    return found


# Real layer sizes on the GPU (skipped without one): the deterministic formulation must hold
# where XLA's GPU scatters and reductions would otherwise differ from run to run.
GPU_LAYERS = {
    "qwen3_30b_a3b": (presets["qwen3_30b_a3b"], 4096),
    "mixtral_8x7b": (presets["mixtral_8x7b"], 2048),
    "deepseek_v3_e32": (dataclasses.replace(presets["deepseek_v3"], num_experts=32), 2048),
}


class _LayerTest(chex.TestCase):
    """What every implementation must do. Subclasses set `implementation`, the dtypes it
    computes in (`compute_dtypes`: a test of another compute dtype is skipped), whether its
    forward and backward are free of scatter-adds (`scatter_free`: the deterministic
    formulation; the reference is a plain per-expert loop), the platform the scatter check
    lowers for (`lowering_platforms`: None for this backend, where the kernels run in interpret
    mode, which lowering for CUDA cannot take), and its tests of the fast tier (`fast`: name
    prefixes of the generated test methods; every other test of the subclass, but its GPU
    tests, is marked slow). A kernel implementation runs its kernels in interpret mode, slowly,
    so it may check its values against the reference on fewer presets (`presets`) and skip the
    tests of the stages it shares with `xla` (`xla_stage_tests`: name prefixes; routing,
    capacity, casts and shapes are the same code in every implementation but the reference,
    and `XlaLayerTest` runs them)."""

    implementation: str
    compute_dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    scatter_free: bool = True
    lowering_platforms: tuple[str, ...] | None = ("cuda",)
    fast: tuple[str, ...] = ()
    presets: tuple[str, ...] = tuple(sorted(SCALED_PRESETS))
    xla_stage_tests: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "implementation" not in cls.__dict__:  # a base of several implementations
            return
        for name in dir(cls):
            test = getattr(cls, name)
            if not name.startswith("test") or not callable(test) or name.startswith(cls.fast):
                continue
            if any(mark.name == "gpu" for mark in getattr(test, "pytestmark", [])):
                continue
            # A copy of the method for this subclass, so the mark stays on this one.
            copy = functools.wraps(test)(_call(test))
            if name.startswith(cls.xla_stage_tests):
                copy = unittest.skip(f"{cls.implementation!r} runs xla's code here")(copy)
            setattr(cls, name, pytest.mark.slow(copy))

    def skip_unless_it_computes_in(self, dtype) -> None:
        if jnp.dtype(dtype).name not in self.compute_dtypes:
            self.skipTest(f"{self.implementation!r} computes in {self.compute_dtypes}")

    def skip_unless_scatter_free(self) -> None:
        if not self.scatter_free:
            self.skipTest(f"{self.implementation!r} is the oracle: its gradients scatter-add")

    def cfg(self, base: MoEConfig = TINY, **changes) -> MoEConfig:
        return with_impl(base, self.implementation, **changes)

    def check_against_reference(
        self,
        cfg: MoEConfig,
        num_tokens: int = 40,
        seed: int = 0,
        bias: dict[int, float] | None = None,
        x_dtype=None,
    ):
        """Values, aux and every gradient (one random cotangent) of `cfg` vs the reference."""
        x, params, cotangent = random_inputs(cfg, num_tokens, seed, x_dtype=x_dtype)
        for expert, value in (bias or {}).items():  # steer the routing towards or away
            params = dataclasses.replace(
                params, router_bias=params.router_bias.at[expert].set(value)
            )
        (_, (y, aux)), grads = value_and_grads(x, params, cotangent, cfg=cfg)
        reference = with_impl(cfg, "reference")
        (_, (y_ref, aux_ref)), grads_ref = value_and_grads(x, params, cotangent, cfg=reference)
        chex.assert_shape(y, x.shape)
        chex.assert_type(y, x.dtype)
        assert_close(y, y_ref, cfg.dtype)
        assert_aux_equal(aux, aux_ref)
        assert_close(grads, grads_ref, cfg.dtype)
        chex.assert_tree_all_finite(grads)
        return aux, grads

    @parameterized.product(preset=sorted(SCALED_PRESETS), dtype=("float32", "bfloat16"))
    def test_matches_reference(self, preset, dtype):
        self.skip_unless_it_computes_in(dtype)
        if preset not in self.presets:
            self.skipTest(f"{self.implementation!r} is checked on the presets {self.presets}")
        cfg = self.cfg(SCALED_PRESETS[preset], dtype=dtype)
        self.check_against_reference(cfg, num_tokens=48, seed=len(preset))

    @chex.variants(with_jit=True, without_jit=True)
    def test_forward_with_and_without_jit(self):
        cfg = self.cfg()
        x, params, _ = random_inputs(cfg, 24, seed=1)
        y, aux = self.variant(functools.partial(moe, cfg=cfg))(x, params)
        y_ref, aux_ref = moe(x, params, with_impl(cfg, "reference"))
        assert_close(y, y_ref, cfg.dtype)
        assert_aux_equal(aux, aux_ref)

    def test_expert_with_no_tokens(self):
        aux, grads = self.check_against_reference(self.cfg(), bias={3: -10.0})
        self.assertEqual(int(aux.tokens_per_expert[3]), 0)
        for name in ("w_gate", "w_up", "w_down"):
            chex.assert_trees_all_equal(
                getattr(grads[1], name)[3], jnp.zeros_like(getattr(grads[1], name)[3])
            )

    def test_all_tokens_to_one_expert(self):
        for top_k in (1, 3):
            cfg = self.cfg(top_k=top_k)
            aux, _ = self.check_against_reference(cfg, num_tokens=33, bias={5: 10.0})
            self.assertEqual(int(aux.tokens_per_expert[5]), 33)

    @parameterized.parameters(1, 8)
    def test_top_k_edges(self, top_k):  # k = 1 and k = E
        cfg = self.cfg(top_k=top_k, norm_topk_prob=True)
        aux, _ = self.check_against_reference(cfg, num_tokens=20)
        self.assertEqual(int(aux.tokens_per_expert.sum()), 20 * top_k)

    @parameterized.parameters(1, 2, 37)
    def test_token_counts(self, num_tokens):  # T = 1 and T a multiple of nothing
        self.check_against_reference(self.cfg(), num_tokens=num_tokens)

    def test_capacity_drops_like_switch(self):
        cfg = self.cfg(SCALED_PRESETS["switch"], num_experts=8)  # top-1, capacity factor 1.25

        aux, _ = self.check_against_reference(cfg, num_tokens=64, bias={0: 0.05})
        capacity = cfg.capacity(64)
        self.assertEqual(capacity, 10)
        overflow = np.maximum(np.asarray(aux.tokens_per_expert) - capacity, 0).sum()
        self.assertGreater(int(aux.dropped), 0)
        self.assertEqual(int(aux.dropped), int(overflow))

    @parameterized.parameters(2, 4)
    def test_capacity_with_several_slots(self, top_k):
        cfg = self.cfg(top_k=top_k, capacity_factor=1.0)

        aux, _ = self.check_against_reference(cfg, num_tokens=40, bias={0: 0.3})
        self.assertGreater(int(aux.dropped), 0)

    @parameterized.parameters(("float32", "bfloat16"), ("bfloat16", "float32"))
    def test_input_and_compute_dtypes_differ(self, x_dtype, compute_dtype):
        self.skip_unless_it_computes_in(compute_dtype)
        self.check_against_reference(self.cfg(dtype=compute_dtype), num_tokens=24, x_dtype=x_dtype)

    def test_leading_dimensions_are_tokens(self):
        cfg = self.cfg()
        x, params, _ = random_inputs(cfg, 2 * 3 * 5, seed=2)
        y_flat, aux_flat = moe(x, params, cfg)
        y, aux = moe(x.reshape(2, 3, 5, cfg.d_model), params, cfg)
        chex.assert_shape(y, (2, 3, 5, cfg.d_model))
        chex.assert_trees_all_equal(y.reshape(y_flat.shape), y_flat)
        chex.assert_trees_all_equal(aux, aux_flat)

    @parameterized.parameters(
        ("float32", "bfloat16"), ("bfloat16", "float32"), ("float16", "float32")
    )
    def test_output_has_input_dtype(self, x_dtype, compute_dtype):
        self.skip_unless_it_computes_in(compute_dtype)
        cfg = self.cfg(dtype=compute_dtype)
        x, params, _ = random_inputs(cfg, 16, x_dtype=x_dtype)
        y, _ = moe(x, params, cfg)
        chex.assert_type(y, jnp.dtype(x_dtype))

    def test_no_tokens(self):
        cfg = self.cfg()
        params = init_params(jax.random.key(0), cfg)
        y, aux = moe(jnp.zeros((0, cfg.d_model), jnp.bfloat16), params, cfg)
        chex.assert_shape(y, (0, cfg.d_model))
        self.assertEqual(int(aux.tokens_per_expert.sum()), 0)

    @parameterized.parameters("float32", "bfloat16")
    def test_bitwise_repeatable(self, dtype):
        self.skip_unless_it_computes_in(dtype)
        cfg = self.cfg(SCALED_PRESETS["deepseek_v3"], dtype=dtype)
        x, params, cotangent = random_inputs(cfg, 64, seed=3)
        first = value_and_grads(x, params, cotangent, cfg=cfg)
        again = value_and_grads(x, params, cotangent, cfg=cfg)
        fresh = jit_value_and_grads()(x, params, cotangent, cfg=cfg)
        chex.assert_trees_all_equal(first, again)
        chex.assert_trees_all_equal(first, fresh)

    def test_router_bias_gets_no_gradient(self):
        _, grads = self.check_against_reference(self.cfg(SCALED_PRESETS["deepseek_v3"]))
        chex.assert_trees_all_equal(grads[1].router_bias, jnp.zeros_like(grads[1].router_bias))

    def test_traced_once_per_shape(self):
        # chex counts the traces of `forward` by its code, which every subclass's copy of this
        # test shares (in one process): the count starts at zero for this one.
        chex.clear_trace_counter()
        cfg = self.cfg()
        _, params, _ = random_inputs(cfg, 8)

        @jax.jit
        @chex.assert_max_traces(n=1)
        def forward(x, params):
            return moe(x, params, cfg)

        for seed in range(3):
            # Waited for: GPU interpret mode's callbacks run jax operations of their own, and
            # the next inputs' operations, dispatched while they run, can deadlock with them.
            jax.block_until_ready(forward(random_inputs(cfg, 8, seed=seed)[0], params))

    @parameterized.parameters("deepseek_v3", "switch", "qwen3_30b_a3b")
    def test_no_scatter_add_when_lowered(self, preset):
        """For CUDA (the kernel implementations: for this backend, their kernels as
        interpret-mode callbacks; the kernels have no atomics, invariants 2 and 3 of the grouped
        GEMMs, and tests/pallas_kernels/test_contracts.py lowers them for CUDA)."""
        self.skip_unless_scatter_free()
        cfg = self.cfg(SCALED_PRESETS[preset])
        x, params, cotangent = random_inputs(cfg, 32)
        traced = value_and_grads.trace(x, params, cotangent, cfg=cfg)
        platforms = self.lowering_platforms
        lowered = (
            traced.lower() if platforms is None else traced.lower(lowering_platforms=platforms)
        )
        combiners = scatter_combiners(lowered.as_text())
        self.assertFalse(
            [c for c in combiners if "add" in c],
            f"scatter-adds on the forward/backward path: {combiners}",
        )

    def test_no_float_scatter_add_after_compilation(self):
        self.skip_unless_scatter_free()
        cfg = self.cfg(SCALED_PRESETS["deepseek_v3"])
        x, params, cotangent = random_inputs(cfg, 32)
        compiled = value_and_grads.lower(x, params, cotangent, cfg=cfg).compile()
        self.assertEqual(compiled_float_scatter_adds(compiled.as_text()), [])

    @parameterized.parameters(*sorted(GPU_LAYERS))
    @pytest.mark.gpu
    def test_gpu_real_size_repeatable_and_matches_reference(self, name):
        """At real layer sizes on the GPU: the same bits on a second run, the reference's
        values, no float scatter-add in the compiled program."""
        if self.implementation == "reference":
            self.skipTest("the reference is the oracle of this test")
        cfg, num_tokens = GPU_LAYERS[name]
        cfg = self.cfg(cfg)
        x, params, cotangent = random_inputs(cfg, num_tokens, seed=11)
        compiled = value_and_grads.lower(x, params, cotangent, cfg=cfg).compile()
        self.assertEqual(compiled_float_scatter_adds(compiled.as_text()), [])
        first = compiled(x, params, cotangent)
        chex.assert_trees_all_equal(first, compiled(x, params, cotangent))
        reference = value_and_grads(x, params, cotangent, cfg=with_impl(cfg, "reference"))
        assert_close_results(first, reference, cfg.dtype)


def _call(method):
    """A new function that calls `method` (the subclass's copy of an inherited test)."""

    def call(self, *args, **kwargs):
        return method(self, *args, **kwargs)

    return call


# The kernel implementations' checks against the reference: the presets of the grouped GEMMs'
# shape classes (many narrow experts, few wide ones, shared experts with group-limited routing).
KERNEL_PRESETS = ("deepseek_v3", "mixtral_8x7b", "qwen3_30b_a3b")
# Tests of stages that `pallas` and `fused` run as `xla`'s code (the router's gradient, capacity
# and drops, input and output casts, leading dimensions, jit against eager).
XLA_STAGE_TESTS = (
    "test_router_bias_gets_no_gradient",
    "test_capacity_",
    "test_input_and_compute_dtypes_differ",
    "test_output_has_input_dtype",
    "test_leading_dimensions_are_tokens",
    "test_forward_with_and_without_jit",
)


class ReferenceLayerTest(_LayerTest):
    """implementation="reference": the oracle held to the layer's contract (shapes, dtypes,
    counts, edge cases, repeatability); its values are the others' reference."""

    implementation = "reference"
    scatter_free = False
    fast = ("test_token_counts0", "test_no_tokens", "test_top_k_edges0")


class XlaLayerTest(_LayerTest):
    implementation = "xla"
    fast = (
        "test_token_counts0",
        "test_no_tokens",
        "test_no_scatter_add_when_lowered",
        "test_output_has_input_dtype",
        "test_traced_once_per_shape",
    )


class _KernelLayerTest(_LayerTest):
    """What the kernel implementations share: bf16/f16 compute, interpret mode on this
    backend, fewer presets and no tests of the stages they run as xla's code."""

    compute_dtypes = ("bfloat16", "float16")
    lowering_platforms = None
    presets = KERNEL_PRESETS
    xla_stage_tests = XLA_STAGE_TESTS


class PallasLayerTest(_KernelLayerTest):
    """implementation="pallas": the Mosaic GPU grouped GEMMs over the layer's tiles (in GPU
    interpret mode on a CPU backend), in bfloat16 or float16."""

    implementation = "pallas"
    fast = ("test_token_counts0", "test_no_tokens", "test_config_rejects")

    def test_config_rejects_what_the_kernels_cannot_take(self):
        with self.assertRaisesRegex(ValueError, "bfloat16 or float16, not dtype=float32"):
            with_impl(TINY, "pallas", dtype=jnp.float32)
        with self.assertRaisesRegex(ValueError, "d_ff=96 to be a multiple of 64"):
            with_impl(TINY, "pallas", d_ff=96)


class FusedLayerTest(_KernelLayerTest):
    """implementation="fused" (one device): the rows read straight from the tokens by the
    gate/up kernel, the routing weights applied in the down kernel's epilogue (GPU interpret
    mode on a CPU backend); its y is `pallas`'s, bit for bit."""

    implementation = "fused"
    fast = ("test_token_counts0", "test_no_tokens", "test_config_and_mesh_reject")

    def test_matches_reference_and_gives_the_pallas_bits(self):
        cfg = with_impl(SCALED_PRESETS["qwen3_30b_a3b"], "fused")
        x, params, cotangent = random_inputs(cfg, 40, seed=3)
        result = value_and_grads(x, params, cotangent, cfg=cfg)
        reference = value_and_grads(x, params, cotangent, cfg=with_impl(cfg, "reference"))
        assert_close_results(result, reference, cfg.dtype)
        (_, (y, _)), _ = result
        # Gradients differ from pallas's in their f32 roundings (the weight gradients sum
        # unpadded row blocks, the routing weights' gradient is a sum over F in the experts'
        # backward, not over D in the combine's).
        (_, (y_pallas, _)), _ = value_and_grads(x, params, cotangent, cfg=with_impl(cfg, "pallas"))
        chex.assert_trees_all_equal(y, y_pallas)

    def test_rows_gathered_by_the_kernel_give_the_copied_rows_bits(self):
        # options.rows: the gate/up kernel loading its rows from the tokens itself, or running on
        # their copy, are the same product (invariant 8 of the grouped-GEMM kernels), and the
        # backward is the same: values and gradients bit for bit.
        cfg = with_impl(SCALED_PRESETS["qwen3_30b_a3b"], "fused", rows="gathered")
        copied_cfg = with_impl(cfg, "fused", rows="copied")
        x, params, cotangent = random_inputs(cfg, 24, seed=4)
        gathered = value_and_grads(x, params, cotangent, cfg=cfg)
        copied = value_and_grads(x, params, cotangent, cfg=copied_cfg)
        chex.assert_trees_all_equal(gathered, copied)
        # The two run different forwards: only "copied" gathers the tokens into [N, D] rows.
        copy = f"bf16[{24 * cfg.top_k},{cfg.d_model}] = gather"
        for c, copies in ((cfg, False), (copied_cfg, True)):
            forward = jax.make_jaxpr(lambda x, p, c=c: moe(x, p, c)[0])(x, params)
            self.assertEqual(copy in str(forward), copies, c.options.rows)

    def test_saved_gate_up_match_reference_with_two_gemm_passes_fewer(self):
        # residuals="gate_up": the forward's kernel also stores gate and up, and the
        # backward uses them (and h) instead of recomputing: same y, gradients to tolerance (the
        # SwiGLU derivative sees gate and up rounded to bf16), two GEMM passes fewer: one gmm
        # for dy @ w_down.T where "inputs" also runs the forward's gmm_swiglu kernel again
        # (gate and up: one kernel more, recompute="gmm") or gmm_swiglu_bwd (gate, up and
        # that product in one kernel: "kernel").
        cfg = with_impl(SCALED_PRESETS["qwen3_30b_a3b"], "fused", residuals="gate_up")
        inputs_cfg = with_impl(cfg, "fused", residuals="inputs")
        kernel_cfg = with_impl(inputs_cfg, "fused", recompute="kernel")
        x, params, cotangent = random_inputs(cfg, 24, seed=6)
        result = value_and_grads(x, params, cotangent, cfg=cfg)
        reference = value_and_grads(x, params, cotangent, cfg=with_impl(cfg, "reference"))
        assert_close_results(result, reference, cfg.dtype)
        # Only y is compared between the three: their forwards alone give it (a forward and
        # backward of each would run the backward's kernels for nothing).
        forward = jax.jit(lambda x, params, cfg: moe(x, params, cfg)[0], static_argnames="cfg")
        y = forward(x, params, cfg=cfg)
        for other in (inputs_cfg, kernel_cfg):
            chex.assert_trees_all_equal(y, forward(x, params, cfg=other))

        def kernels(c):
            """(kernel calls, gmm_swiglu_bwd calls) of the forward and backward."""
            # A kernel call is a pallas_call on a GPU backend, its interpret-mode wrapper a
            # custom_vmap_call on a CPU one (the configs share every other such call).
            grads = jax.grad(lambda x, p: loss_and_outputs(x, p, cotangent, c)[0], (0, 1))
            with mock.patch.object(
                mosaic_gpu, "gmm_swiglu_bwd", wraps=mosaic_gpu.gmm_swiglu_bwd
            ) as spy:
                text = str(jax.make_jaxpr(grads)(x, params))
            return text.count("pallas_call") + text.count("custom_vmap_call"), spy.call_count

        saved_kernels, saved_spy = kernels(cfg)
        self.assertEqual(saved_spy, 0)
        self.assertEqual(kernels(kernel_cfg), (saved_kernels, 1))
        self.assertEqual(kernels(inputs_cfg), (saved_kernels + 1, 0))

    def test_drops_and_shared_experts_match_reference(self):
        # Capacity 1.0: rows past an expert's capacity are dropped (their weight is 0 in the
        # down kernel's epilogue); one shared expert on every token.
        cfg = with_impl(SCALED_PRESETS["deepseek_v3"], "fused", capacity_factor=1.0)
        x, params, cotangent = random_inputs(cfg, 40, seed=5)
        result = value_and_grads(x, params, cotangent, cfg=cfg)
        (_, (_, aux)), _ = result
        self.assertGreater(int(aux.dropped), 0)
        reference = value_and_grads(x, params, cotangent, cfg=with_impl(cfg, "reference"))
        assert_close_results(result, reference, cfg.dtype)

    def test_fully_dropped_tokens_give_the_pallas_bits_and_positive_zeros(self):
        # Capacity 0.25: one row per expert is kept, so most tokens lose every slot (no shared
        # expert): their y is +0, as in `pallas`, not the -0 of the kernel's 0 * (negative y).
        cfg = with_impl(TINY, "fused", capacity_factor=0.25)
        x, params, _ = random_inputs(cfg, 16, seed=2)
        y, aux = moe(x, params, cfg)
        y_pallas, _ = moe(x, params, with_impl(cfg, "pallas"))
        self.assertGreater(int(aux.dropped), 16)
        bits = np.asarray(y, np.float32).view(np.uint32)
        np.testing.assert_array_equal(bits, np.asarray(y_pallas, np.float32).view(np.uint32))
        self.assertFalse(np.any(np.signbit(np.asarray(y, np.float32)) & (np.asarray(y) == 0)))

    def test_no_scatter_add_on_the_forward_and_backward_path(self):
        # The XLA ops around the kernels (the kernels have no atomics: invariants 2 and 3 of
        # the grouped-GEMM kernels); on a CPU backend the kernels lower as interpret-mode
        # callbacks, so this is the lowering for this backend, not for CUDA.
        cfg = with_impl(SCALED_PRESETS["deepseek_v3"], "fused", capacity_factor=1.0)
        x, params, cotangent = random_inputs(cfg, 32)
        lowered = value_and_grads.trace(x, params, cotangent, cfg=cfg).lower()
        combiners = scatter_combiners(lowered.as_text())
        self.assertFalse(
            [c for c in combiners if "add" in c],
            f"scatter-adds on the forward/backward path: {combiners}",
        )

    def test_config_and_mesh_reject_what_it_cannot_run(self):
        with self.assertRaisesRegex(ValueError, "'fused' computes in bfloat16 or float16"):
            with_impl(TINY, "fused", dtype=jnp.float32)
        with self.assertRaisesRegex(ValueError, "'fused' needs d_model=96 to be a multiple of 64"):
            with_impl(TINY, "fused", d_model=96)
        with self.assertRaisesRegex(ValueError, "rows='both' must be 'auto' or one of"):
            with_impl(TINY, "fused", rows="both")

    @pytest.mark.gpu
    def test_gpu_real_size_gives_the_pallas_y_bits(self):
        cfg, num_tokens = GPU_LAYERS["qwen3_30b_a3b"]
        cfg = with_impl(cfg, "fused")
        x, params, cotangent = random_inputs(cfg, num_tokens, seed=11)
        (_, (y, _)), _ = value_and_grads(x, params, cotangent, cfg=cfg)
        (_, (y_pallas, _)), _ = value_and_grads(x, params, cotangent, cfg=with_impl(cfg, "pallas"))
        chex.assert_trees_all_equal(y, y_pallas)


class FusedRouterKernelLayerTest(_KernelLayerTest):
    """implementation="fused" with router="kernel": the router's forward as one Mosaic GPU kernel
    (pallas_kernels/routing, GPU interpret mode on a CPU backend), which routes bf16 tokens.
    The router's gradient and the capacity's plan run on its outputs here: those tests run."""

    implementation = "fused"
    compute_dtypes = ("bfloat16",)
    fast = ("test_token_counts0", "test_router_kernel")
    xla_stage_tests = tuple(
        name
        for name in XLA_STAGE_TESTS
        if name not in ("test_router_bias_gets_no_gradient", "test_capacity_")
    )

    def cfg(self, base: MoEConfig = TINY, **changes) -> MoEConfig:
        return with_impl(base, "fused", router="kernel", **changes)

    def test_router_kernel_takes_bf16_tokens_only(self):
        cfg = self.cfg()
        x, params, _ = random_inputs(cfg, 8, x_dtype=jnp.float32)
        with self.assertRaisesRegex(ValueError, "router='kernel' routes bfloat16 tokens"):
            moe(x, params, cfg)
        with self.assertRaisesRegex(ValueError, "at most 256 experts"):
            resolve(self.cfg(num_experts=320), num_tokens=8)

    def test_router_kernel_routes_as_the_xla_router(self):
        # The kernel's logits sum in another order than XLA's: on these inputs no token has a
        # near tie, so both route alike, with weights within f32 rounding.
        cfg = self.cfg(SCALED_PRESETS["deepseek_v3"])
        x, params, cotangent = random_inputs(cfg, 48, seed=7)
        kernel = value_and_grads(x, params, cotangent, cfg=cfg)
        xla = value_and_grads(x, params, cotangent, cfg=with_impl(cfg, "fused", router="xla"))
        (_, (_, aux)), _ = kernel
        (_, (_, aux_xla)), _ = xla
        chex.assert_trees_all_equal(aux.tokens_per_expert, aux_xla.tokens_per_expert)
        assert_close_results(kernel, xla, cfg.dtype)


del _LayerTest, _KernelLayerTest  # the bases hold no implementation of their own


def test_token_chunk_sets_the_token_wise_stages_steps():
    # 40 tokens in chunks of 16: route and combine map 3 chunks of [16, ...]; by default
    # (8 * row_tile = 64 tokens) 2 chunks, the second all padding.
    cfg = with_impl(TINY, TINY.implementation, token_chunk=16)
    x, params, _ = random_inputs(cfg, 40)
    text = str(jax.make_jaxpr(lambda x, p: moe(x, p, cfg))(x, params))
    assert f"[3,16,{cfg.d_model}]" in text
    default = str(jax.make_jaxpr(lambda x, p: moe(x, p, TINY))(x, params))
    chunk = 8 * TINY.row_tile
    assert f"[2,{chunk},{cfg.d_model}]" in default and f",16,{cfg.d_model}]" not in default


def test_compiled_float_scatter_adds_finds_one():
    """The compiled check above can fail: it sees a gather gradient's scatter-add."""
    compiled = (
        jax.jit(jax.grad(lambda a, i: jnp.sum(a[i] * a[i])))
        .lower(jnp.ones(4), jnp.array([0, 0, 1]))
        .compile()
    )
    assert len(compiled_float_scatter_adds(compiled.as_text())) == 1


def test_scatter_combiners_finds_an_add():
    """The lowering check above can fail: a gather's autodiff gradient is a scatter-add."""
    lowered = (
        jax.jit(jax.grad(lambda a: a[jnp.array([0, 0, 1])].sum()))
        .trace(jnp.ones(4))
        .lower(lowering_platforms=("cuda",))
    )
    assert any("add" in c for c in scatter_combiners(lowered.as_text()))


class TestBadInput:
    cfg = TINY
    params = init_params(jax.random.key(0), TINY)

    @pytest.mark.parametrize(
        "x, message",
        [
            (jnp.ones((4, 64), jnp.int32), "floating dtype"),
            (jnp.ones((4, 63)), "d_model=64"),
            (jnp.ones(()), "d_model=64"),
        ],
    )
    def test_bad_x(self, x, message):
        with pytest.raises(ValueError, match=message):
            moe(x, self.params, self.cfg)

    def test_mismatched_params(self):
        bad = dataclasses.replace(self.params, w_up=jnp.ones((8, 64, 64)))
        with pytest.raises(
            ValueError,
            match=r"w_up has shape \(8, 64, 64\), expected "
            r"\(8, 64, 128\)",
        ):
            moe(jnp.ones((4, 64)), bad, self.cfg)

    def test_missing_shared_experts(self):
        cfg = SCALED_PRESETS["deepseek_v3"]
        params = init_params(jax.random.key(0), cfg)
        bad = dataclasses.replace(params, shared_w_up=None)
        with pytest.raises(ValueError, match="shared_w_up is None"):
            moe(jnp.ones((4, cfg.d_model)), bad, cfg)

    def test_params_for_another_config(self):
        with pytest.raises(ValueError, match="router has shape"):
            moe(jnp.ones((4, 64)), self.params, SCALED_PRESETS["qwen3_30b_a3b"])

    def test_config_must_be_a_config(self):
        with pytest.raises(ValueError, match="cfg must be a MoEConfig"):
            moe(jnp.ones((4, 64)), self.params, {"d_model": 64})


_DIGEST_SCRIPT = """
import hashlib, sys
import jax, numpy as np
from tests.mok_jax.cases import random_inputs, value_and_grads
from tests.mok_jax.test_layer import GPU_LAYERS
cfg, num_tokens = GPU_LAYERS[sys.argv[1]]
x, params, cotangent = random_inputs(cfg, num_tokens, seed=11)
digest = hashlib.sha256()
for leaf in jax.tree.leaves(value_and_grads(x, params, cotangent, cfg=cfg)):
    digest.update(np.asarray(leaf).tobytes())
print(digest.hexdigest())
"""


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_LAYERS))
def test_gpu_same_bits_in_another_process(name):
    """Two processes compile separately: with `compiler_options` (used by
    `value_and_grads`) the autotuner cannot pick different GEMM algorithms in each."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    digests = [
        subprocess.run(
            [sys.executable, "-c", _DIGEST_SCRIPT, name],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout.split()[-1]
        for _ in range(2)
    ]
    assert digests[0] == digests[1]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_30b_a3b", "deepseek_v3_e32"])
def test_gpu_fused_residual_modes_give_the_same_bits(name):
    """`fused` with residuals "gate_up" (the forward kernel's h, gate and up kept) and with
    "inputs" (recomputed by the same kernel in the backward): the same y and gradient bits on
    the GPU's kernels, so the automatic choice between them (gate_up on one device, inputs
    under the in-kernel exchange) keeps the bits contract."""
    cfg, num_tokens = GPU_LAYERS[name]
    cfg = with_impl(cfg, "fused")
    x, params, cotangent = random_inputs(cfg, num_tokens, seed=11)
    kept = value_and_grads(x, params, cotangent, cfg=cfg.with_options(residuals="gate_up"))
    recomputed = cfg.with_options(residuals="inputs", recompute="gmm")
    chex.assert_trees_all_equal(kept, value_and_grads(x, params, cotangent, cfg=recomputed))
