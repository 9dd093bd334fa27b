"""implementation="fused" under a mesh: the exchange inside kernels.

Each round's dispatch and return are the exchange's kernels (`pallas_kernels.exchange`: remote
copies and semaphores, into the protocol's tile-aligned expert-major buffers); the grouped-GEMM
kernels run on those buffers with the routing weights in the down projection's epilogue. On
the CPU the exchange runs its all_gather spec (Mosaic GPU's interpret mode has no remote refs or
semaphores) and the GEMM kernels run in GPU interpret mode; the forward+backward is also lowered
for CUDA on 8 devices with the exchange kernels themselves. y and dx are the bits of `fused` on
one device (a row meets the same kernels, whatever its tile); the weights' gradients, summed
over rounds and devices, are held to the bf16 tolerance.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mok_jax import (
    MoEOptions,
    gpu_target,
    make_mesh,
    presets,
    resolve,
    targeting,
)
from mok_jax.resolve import GPU_TOKEN_CHUNK
from pallas_kernels.exchange import mosaic_gpu, protocol, reference
from tests.mok_jax.cases import (
    SCALED_PRESETS,
    assert_same_rows,
    num_gpus,
    random_inputs,
    with_impl,
)
from tests.mok_jax.test_expert_parallel import (
    loss_and_outputs,
    steer,
    value_and_grads,
    value_and_grads_fn,
)
from tests.mok_jax.test_pallas_mesh import (
    MOSAIC_GPU_CALL,
    gpu_interpret_on_several_devices,
    lowered_with_kernels,
)

# dispatch_swiglu's custom call: it returns the buffer [S, D], its routing weights [S, 4] f32 and
# h [S, F] (then the kernel's semaphores).
OVERLAPPED_DISPATCH = re.compile(
    r"custom_call @mosaic_gpu.*-> \(tensor<(\d+)x\d+xbf16>, tensor<\1x4xf32>, tensor<\1x\d+xbf16>"
)

# down_return's custom call: it returns the results y [S, D] f32 and the rows back [N, D] f32.
OVERLAPPED_RETURN = re.compile(
    r"custom_call @mosaic_gpu.*-> \(tensor<\d+x(\d+)xf32>, tensor<\d+x\1xf32>"
)

# dispatch_down_grad's custom call (the backward's dispatch): the cotangent rounded to bf16
# [S, D] (once: its product with the weights is formed at the buffer), the rows x [S, D] and
# their weights [S, 4] f32 again, and g [S, F] f32.
OVERLAPPED_COTANGENT = re.compile(
    r"custom_call @mosaic_gpu.*-> \(tensor<(\d+)x(\d+)xbf16>, tensor<\1x\2xbf16>, "
    r"tensor<\1x4xf32>, tensor<\1x\d+xf32>"
)

# dgrad_return's custom call (the backward's way back): the input gradient d_buffer [S, D] bf16,
# the rows' gradient at their sources [N, D] bf16 and the routing weights' [N, 4] f32 (then the
# kernel's counters).
OVERLAPPED_INPUT_GRAD = re.compile(
    r"custom_call @mosaic_gpu.*-> \(tensor<\d+x(\d+)xbf16>, tensor<(\d+)x\1xbf16>, "
    r"tensor<\2x4xf32>, tensor<\d+xi32>"
)

# dispatch_mlp_return's custom call (a round's forward in one kernel): the buffer [S, D], its
# routing weights [S + block_m, 4] f32, h [S, F], y [S, D] f32 and the rows back [N, D] f32.
ONE_KERNEL_FORWARD = re.compile(
    r"custom_call @mosaic_gpu.*-> \(tensor<(\d+)x(\d+)xbf16>, tensor<\d+x4xf32>, "
    r"tensor<\1x\d+xbf16>, tensor<\1x\2xf32>, tensor<\d+x\2xf32>"
)

# Small enough for interpret mode: 8 experts, top-2, 8-row tiles (D = F = 64); a window of
# three eighths of the balanced load, so the exchange takes three rounds (each costs a forward
# and a backward in interpret mode), the rounds loop's body runs twice and the last round is
# partial (at 32 tokens on EP 2: 32 rows a device through windows of 12); and an exchange tile
# of 4 rows, so an expert's rows of a round span several tiles.
QWEN3 = dataclasses.replace(
    SCALED_PRESETS["qwen3_30b_a3b"],
    implementation="fused",
    num_experts=8,
    top_k=2,
    row_tile=8,
    buffer_factor=0.375,
    options=MoEOptions(exchange_tile=4),
)
NUM_TOKENS = 32


@functools.cache
def one_device(cfg, seed):
    """'fused' without a mesh: ((loss, (y, aux)), (dx, dparams))."""
    return value_and_grads(*random_inputs(cfg, NUM_TOKENS, seed), cfg, None)


@pytest.mark.slow
def test_two_devices_equal_one():
    """EP 2 in several rounds, with an exchange tile of 3 rows (the module's tile of 4 on EP 2
    is test_nothing_reads_the_rows_the_kernel_leaves_unspecified's case "gmm", which also
    fills the rows the exchange leaves unspecified with NaN); then 2 devices on the data axis
    (EP 1) with the exchange: its copies go to the device itself, in several rounds. The data
    axis without the exchange (the default there: each device runs `fused` as without a mesh,
    in one round) is test_a_data_axes_mesh_runs_each_device_as_one's."""
    x, params, cotangent = random_inputs(QWEN3, NUM_TOKENS, 0)
    base = one_device(QWEN3, 0)
    ep2 = make_mesh("expert", devices=jax.devices()[:2])
    dp2 = make_mesh("data_expert", data=2, devices=jax.devices()[:2])
    with_exchange = with_impl(QWEN3, "fused", exchange_on_one_device=True)
    with gpu_interpret_on_several_devices():
        for mesh, cfg in ((ep2, with_impl(QWEN3, "fused", exchange_tile=3)), (dp2, with_exchange)):
            result = value_and_grads(x, params, cotangent, cfg, mesh)
            assert int(result[0][1][1].rounds) >= 2
            assert_same_rows(result, base, QWEN3.dtype)


@pytest.mark.slow
def test_the_router_kernel_keeps_the_bits_across_meshes():
    """router "kernel": each token routed, and its input gradient formed, by its own row of a
    kernel tile, so y and dx are the bits of one device on EP 2 and on a 2 x 2 data x expert
    mesh (one round each: a buffer above the load). 160 tokens: each device's tokens span
    several tiles, the last partial, and tiles start elsewhere than on one device."""
    cfg = with_impl(QWEN3, "fused", router="kernel", buffer_factor=2.0)
    x, params, cotangent = random_inputs(cfg, 160, 3)
    base = value_and_grads(x, params, cotangent, cfg, None)
    meshes = (
        make_mesh("expert", devices=jax.devices()[:2]),
        make_mesh("data_expert", data=2, devices=jax.devices()[:4]),
    )
    with gpu_interpret_on_several_devices():
        for mesh in meshes:
            assert_same_rows(value_and_grads(x, params, cotangent, cfg, mesh), base, cfg.dtype)


@pytest.mark.slow
def test_automatic_choices_keep_the_bits_across_meshes():
    """implementation and options "auto", built for an H100 (its kernels run in GPU interpret
    mode here): without a mesh the rules keep gate and up (residuals "gate_up"); on EP 2 the
    in-kernel exchange's backward recomputes them ("inputs"); y and dx are the same bits."""
    h100 = dataclasses.replace(gpu_target("NVIDIA H100 80GB HBM3"), run_interpreted=True)
    cfg = dataclasses.replace(QWEN3, implementation="auto")
    x, params, cotangent = random_inputs(cfg, NUM_TOKENS, 0)
    ep2 = make_mesh("expert", devices=jax.devices()[:2])
    alone = resolve(cfg, num_tokens=NUM_TOKENS, target=h100).config
    meshed = resolve(cfg, num_tokens=NUM_TOKENS // 2, meshed=True, expert_devices=2, target=h100)
    assert alone.implementation == meshed.config.implementation == "fused"
    assert (alone.options.residuals, meshed.config.options.residuals) == ("gate_up", "inputs")
    with targeting(h100):
        base = value_and_grads(x, params, cotangent, cfg, None)
        with gpu_interpret_on_several_devices():
            result = value_and_grads(x, params, cotangent, cfg, ep2)
    assert int(result[0][1][1].rounds) >= 2
    assert_same_rows(result, base, cfg.dtype)
    # And those are the bits of `fused` with residuals "inputs" on one device (at the GPU's
    # token chunk: the chunk changes y's last bits).
    inputs = with_impl(QWEN3, "fused", residuals="inputs", token_chunk=GPU_TOKEN_CHUNK)
    assert_same_rows(result, one_device(inputs, 0), cfg.dtype)


@pytest.mark.slow
def test_forced_imbalance_takes_rounds_and_drops_nothing():
    """EP 2 with every token sent to two experts of device 0 (device 1's experts get nothing):
    device 0 receives every row, twice its balanced load, through a buffer of three quarters
    of it, so in more rounds than the balanced load would take; nothing is dropped, and y and
    dx are the bits of one device."""
    cfg = dataclasses.replace(QWEN3, buffer_factor=0.75)
    bias = {0: 10.0, 1: 9.0} | {e: -10.0 for e in range(4, 8)}
    x, params, cotangent = random_inputs(cfg, NUM_TOKENS, 0)
    params = steer(params, bias)
    base = value_and_grads(x, params, cotangent, cfg, None)
    ep2 = make_mesh("expert", devices=jax.devices()[:2])
    with gpu_interpret_on_several_devices():
        result = value_and_grads(x, params, cotangent, cfg, ep2)
    aux = result[0][1][1]
    assert int(aux.rounds) >= 3  # 64 rows for device 0 through 24-row windows (balanced: 2)
    assert int(aux.dropped) == 0
    np.testing.assert_array_equal(np.asarray(aux.tokens_per_expert)[[0, 1]], [NUM_TOKENS] * 2)
    assert_same_rows(result, base, cfg.dtype)


@pytest.mark.slow
@pytest.mark.parametrize("residuals", ["inputs", "gate_up"])
def test_a_data_axes_mesh_runs_each_device_as_one(residuals):
    """2 devices on the data axis (an expert axis of one device): `fused` with or without the
    forward's h, gate and up kept, as without a mesh: y and dx the bits of one device, in one
    round. Gathered rows cannot run there (the gathered rows' kernel takes no operand that
    varies over mesh axes): asked for, they raise rather than run copied."""
    cfg = with_impl(QWEN3, "fused", residuals=residuals)
    x, params, cotangent = random_inputs(cfg, NUM_TOKENS, 0)
    dp2 = make_mesh("data_expert", data=2, devices=jax.devices()[:2])
    with gpu_interpret_on_several_devices():
        result = value_and_grads(x, params, cotangent, cfg, dp2)
        with pytest.raises(ValueError, match="rows='gathered' cannot run under a mesh"):
            value_and_grads(x, params, cotangent, with_impl(cfg, "fused", rows="gathered"), dp2)
    assert int(result[0][1][1].rounds) == 1
    assert_same_rows(result, one_device(cfg, 0), cfg.dtype)


def nan_run(cfg, num_tokens: int):
    """'fused' on an EP 2 mesh with every output row the exchange leaves unspecified filled
    with NaN by its spec: ((loss, (y, aux)), (dx, dparams))."""
    x, params, cotangent = random_inputs(cfg, num_tokens, 0)
    nan_reference = functools.partial(reference.send_rows, unfilled=float("nan"))
    ep2 = make_mesh("expert", devices=jax.devices()[:2])
    # Traced afresh, and not kept: JAX's tracing caches (custom_vjp and loop bodies, keyed on
    # the function and the static config) would otherwise hand this run a trace made without
    # the patches, or a later run one made with them (the control test below patches
    # TAIL_ZERO_ROWS).
    jax.clear_caches()
    try:
        with (
            gpu_interpret_on_several_devices(),
            mock.patch.object(reference, "send_rows", nan_reference),
        ):
            return value_and_grads_fn()(x, params, cotangent, cfg, ep2)
    finally:
        jax.clear_caches()


# A buffer with many slots past the groups: 128 tokens a device (256 rows) in one round of a
# window of 512 rows, so that more than TAIL_ZERO_ROWS slots past the groups stay unspecified.
WIDE_TOKENS = 256


@pytest.mark.slow
@pytest.mark.parametrize(
    "recompute,buffer_factor,num_tokens",
    [
        ("gmm", QWEN3.buffer_factor, NUM_TOKENS),
        ("kernel", QWEN3.buffer_factor, NUM_TOKENS),
        ("gmm", 4.0, WIDE_TOKENS),
        ("kernel", 4.0, WIDE_TOKENS),
    ],
)
def test_nothing_reads_the_rows_the_kernel_leaves_unspecified(recompute, buffer_factor,
                                                              num_tokens):  # fmt: skip
    """The exchange kernel leaves unspecified every output row no copy fills and no zero range
    covers: here the reference fills them with NaN (EP 2: several rounds, or with a wide
    window one round whose buffer has more than TAIL_ZERO_ROWS slots past the groups), and
    y, dx and every parameter gradient must still be finite and, for y and dx, the bits of
    one device."""
    cfg = with_impl(QWEN3, "fused", recompute=recompute, buffer_factor=buffer_factor)
    result = nan_run(cfg, num_tokens)
    for leaf in jax.tree.leaves(result):
        assert np.isfinite(np.asarray(leaf, np.float32)).all(), leaf
    if num_tokens == WIDE_TOKENS:
        aux = result[0][1][1]
        assert int(aux.rounds) == 1
        # The window: min(4 x 256 rows, 128 tokens x top-2 x EP 2) = 512 rows, 4 experts a
        # device; a device's groups end at its rows, each expert's padded to whole tiles.
        tile = cfg.options.exchange_tile
        slots = protocol.num_tiles(512, tile, 4) * tile
        counts_dg = np.asarray(aux.tokens_per_expert).reshape(2, 4)
        ends_d = np.sum(-(-counts_dg // tile) * tile, axis=1)
        assert (slots - ends_d > protocol.TAIL_ZERO_ROWS).any(), (slots, ends_d)
        base = value_and_grads(*random_inputs(cfg, num_tokens, 0), cfg, None)
    else:
        base = one_device(cfg, 0)
    assert_same_rows(result, base, cfg.dtype)


@pytest.mark.slow
def test_the_weight_gradients_read_the_zeroed_slots_past_the_groups():
    """The control of the test above: the weight gradients' kernel reads up to block_k - 1
    slots past the groups (exchange tiles of 4 rows, blocks of 64 in interpret mode), so with
    no zeroed slots there (TAIL_ZERO_ROWS 0) the NaN the spec leaves there reach d_w_gate and
    d_w_up. This is why the dispatch zeroes TAIL_ZERO_ROWS of them."""
    cfg = with_impl(QWEN3, "fused", buffer_factor=4.0)
    with mock.patch.object(protocol, "TAIL_ZERO_ROWS", 0):
        (_, _), (dx, dparams) = nan_run(cfg, WIDE_TOKENS)
    assert np.isfinite(np.asarray(dx, np.float32)).all()
    assert not np.isfinite(np.asarray(dparams.w_gate, np.float32)).all()
    assert not np.isfinite(np.asarray(dparams.w_up, np.float32)).all()


def _weight_converts(jaxpr, shapes, *, in_cond: bool = False) -> tuple[int, int]:
    """(outside any cond, inside a cond): the convert_element_type equations on arrays of
    `shapes` in `jaxpr` and every jaxpr its equations hold."""
    counts = [0, 0]
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type" and eqn.invars[0].aval.shape in shapes:
            counts[in_cond] += 1
        inner = in_cond or eqn.primitive.name == "cond"
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found = _weight_converts(sub, shapes, in_cond=inner)
            counts = [a + b for a, b in zip(counts, found, strict=True)]
    return counts[0], counts[1]


@pytest.mark.slow
def test_one_round_leaves_bf16_weight_gradients_as_they_are():
    """With bf16 weights and one round, the backward returns round 0's weight gradients as its
    kernels give them: no weight-sized convert outside the cond that adds later rounds' in f32
    (six such converts cost 1.72 ms a forward+backward at qwen3 on one H200). The control:
    the cond's branch has the f32 round trip. With bf16 weights, y and dx stay the bits of
    one device, in one round and in several."""
    assert QWEN3.dtype == jnp.bfloat16
    x, params, cotangent = random_inputs(QWEN3, NUM_TOKENS, 0)
    params = jax.tree.map(lambda a: a.astype(QWEN3.dtype), params)
    ep2 = make_mesh("expert", devices=jax.devices()[:2])
    local = QWEN3.num_experts // 2
    shapes = {(local, QWEN3.d_model, QWEN3.d_ff), (local, QWEN3.d_ff, QWEN3.d_model)}
    one_round = with_impl(QWEN3, "fused", buffer_factor=4.0)
    grad = jax.value_and_grad(loss_and_outputs, argnums=(0, 1), has_aux=True)
    jaxpr = jax.make_jaxpr(grad, static_argnums=(3, 4))(x, params, cotangent, one_round, ep2)
    outside, inside = _weight_converts(jaxpr.jaxpr, shapes)
    assert outside == 0
    assert inside >= 6  # 3 to f32 and 3 back
    # Without a mesh there is no exchange, so no window: one base for both (the buffer factor
    # is the two configs' only difference).
    base = value_and_grads(x, params, cotangent, QWEN3, None)
    with gpu_interpret_on_several_devices():
        for cfg, several in ((one_round, False), (QWEN3, True)):
            result = value_and_grads(x, params, cotangent, cfg, ep2)
            rounds = int(result[0][1][1].rounds)
            assert (rounds >= 2) if several else (rounds == 1)
            assert all(g.dtype == QWEN3.dtype for g in jax.tree.leaves(result[1][1]))
            assert_same_rows(result, base, cfg.dtype)


# The fast tier's case of this module: the 2 x 4 mesh's lowering (ep8 adds the lowerings of
# other exchange options).
@pytest.mark.parametrize("layout", [pytest.param("ep8", marks=pytest.mark.slow), "dp2xep4"])
def test_lowered_for_cuda_on_8_devices(layout):
    """The forward+backward lowers for CUDA on EP 8 and on a 2 x 4 (data x expert) mesh (the
    peers addressed along one axis of two) with the exchange's kernels and no collective for
    the rows (the per-expert counts' all_gather and the rounds' pmax stay)."""
    cfg = with_impl(SCALED_PRESETS["deepseek_v3"], "fused")
    devices = jax.devices()[:8]
    mesh = {
        "ep8": lambda: make_mesh("expert", devices=devices),
        "dp2xep4": lambda: make_mesh("data_expert", data=2, devices=devices),
    }[layout]()
    x, params, cotangent = random_inputs(cfg, 64, 0)
    text = lowered_with_kernels(x, params, cotangent, cfg, mesh)
    assert "sdy.manual_computation" in text
    # A round's forward: the dispatch overlapped with gate/up (one kernel), the down
    # projection overlapped with the return (one kernel); its backward the forward again
    # (dead code, which XLA drops: the backward reads none of it), the dispatch of the
    # cotangent, the rows and their weights overlapped with g = dy @ w_down.T (one kernel), the
    # GEMM gradients, the input gradient's GEMM overlapped with its return and the routing
    # weights' gradient's (one kernel).
    assert len(MOSAIC_GPU_CALL.findall(text)) >= 12
    # The overlapped dispatch: one kernel returns the buffer, its weights and h.
    assert OVERLAPPED_DISPATCH.search(text), "no kernel of dispatch and gate/up"
    assert OVERLAPPED_RETURN.search(text), "no kernel of the down projection and the return"
    assert OVERLAPPED_COTANGENT.search(text), "no kernel of the backward's dispatch and g"
    assert OVERLAPPED_INPUT_GRAD.search(text), "no kernel of the input gradient and its return"
    # The backward's kernels twice, round 0's and the rounds loop's; the forward's at least
    # twice (the backward's re-run forward is dead code: JAX's tracing drops part of it, 3 of
    # each in jax 0.11.2, and XLA the rest).
    overlapped = (
        OVERLAPPED_DISPATCH,
        OVERLAPPED_RETURN,
        OVERLAPPED_COTANGENT,
        OVERLAPPED_INPUT_GRAD,
    )
    kernels = [len(k.findall(text)) for k in overlapped]
    assert kernels[2:] == [2, 2] and kernels[0] == kernels[1] >= 2, kernels
    # Invariant 6 of the exchange's kernels: each overlapped kernel has the reader's proxy fence
    # (at its one site, where the rows it loads are waited for).
    lines = text.splitlines()
    exchange = [line for line in lines if any(k.search(line) for k in overlapped)]
    assert len(exchange) == sum(kernels)
    assert all(mosaic_gpu.PROXY_FENCE in line for line in exchange)
    assert "uses_xla_collective_metadata = true" in text
    for collective in ("ragged_all_to_all", "all_to_all", "collective_permute"):
        assert not re.search(rf"stablehlo\.{collective}\b", text), collective
    assert "all_gather" in text  # the per-expert counts
    assert "io_callback" not in text  # no interpret mode left
    if layout == "ep8":  # exchange_programs 0: the dispatch is a kernel of its own
        separate = with_impl(cfg, "fused", exchange_programs=0)
        text = lowered_with_kernels(x, params, cotangent, separate, mesh)
        assert not OVERLAPPED_DISPATCH.search(text)
        assert not OVERLAPPED_RETURN.search(text)
        assert not OVERLAPPED_COTANGENT.search(text)
        assert not OVERLAPPED_INPUT_GRAD.search(text)
        # recompute "kernel": its first backward GEMM also recomputes gate and up, and the
        # backward's dispatch runs in kernels of their own; the input gradient still returns
        # inside its GEMM's kernel.
        fused_bwd = with_impl(cfg, "fused", recompute="kernel")
        text = lowered_with_kernels(x, params, cotangent, fused_bwd, mesh)
        assert OVERLAPPED_DISPATCH.search(text)
        assert not OVERLAPPED_COTANGENT.search(text)
        assert len(OVERLAPPED_INPUT_GRAD.findall(text)) == 2
        # exchange_fusion "forward": a round's forward is one kernel (at least twice, as the
        # two it replaces), with the reader's fence; the backward's kernels stay. Its down
        # tiles split between two consumers as the gate/up ones do: D a multiple of 128.
        narrow = with_impl(cfg, "fused", exchange_fusion="forward")
        with pytest.raises(ValueError, match="exchange_fusion='forward' needs d_model=64"):
            lowered_with_kernels(x, params, cotangent, narrow, mesh)
        one_kernel = with_impl(cfg, "fused", d_model=128, exchange_fusion="forward")
        x, params, cotangent = random_inputs(one_kernel, 64, 0)
        text = lowered_with_kernels(x, params, cotangent, one_kernel, mesh)
        forward = [line for line in text.splitlines() if ONE_KERNEL_FORWARD.search(line)]
        assert len(forward) >= 2 and all(mosaic_gpu.PROXY_FENCE in line for line in forward)
        assert not OVERLAPPED_DISPATCH.search(text)
        assert not OVERLAPPED_RETURN.search(text)
        assert len(OVERLAPPED_COTANGENT.findall(text)) == 2
        assert len(OVERLAPPED_INPUT_GRAD.findall(text)) == 2


@pytest.mark.gpu
@pytest.mark.skipif(num_gpus() < 1, reason="needs a GPU")
@pytest.mark.parametrize("fusion", ["per_gemm", "forward"])
def test_gpu_one_device_mesh_equals_no_mesh(fusion):
    """On one GPU: a 1-device mesh (the exchange's kernels copy to the device itself, in
    several rounds, with each exchange fusion) against `fused` without a mesh, at a real
    width; and, once, the mesh's default there, `fused` as without a mesh (no exchange, one
    round)."""
    cfg = dataclasses.replace(presets["qwen3_30b_a3b"], implementation="fused", buffer_factor=0.3)
    x, params, cotangent = random_inputs(cfg, 2048, 0)
    base = value_and_grads(x, params, cotangent, cfg, None)
    mesh = make_mesh("expert", devices=jax.devices()[:1])
    with_exchange = with_impl(cfg, "fused", exchange_on_one_device=True, exchange_fusion=fusion)
    runs = [(with_exchange, True)] + [(cfg, False)] * (fusion == "per_gemm")
    for run_cfg, several in runs:
        result = value_and_grads(x, params, cotangent, run_cfg, mesh)
        rounds = int(result[0][1][1].rounds)
        assert rounds >= 2 if several else rounds == 1
        assert_same_rows(result, base, cfg.dtype)
