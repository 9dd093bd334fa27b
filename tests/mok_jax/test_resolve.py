"""The automatic choices (`mok_jax.resolve`): their rules on named targets, the errors for
choices that cannot run or do not apply, and the bits contract they keep."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import pytest

import mok_jax
from mok_jax import MoEConfig, MoEOptions, Target, gpu_target, options, presets, resolve, targeting
from mok_jax.options import RESIDUAL_SHARE, current_target
from mok_jax.resolve import GPU_TOKEN_CHUNK, residual_bytes, resolve_implementation

H100 = gpu_target("NVIDIA H100 80GB HBM3")
H200 = gpu_target("NVIDIA H200")
A100 = gpu_target("NVIDIA A100-SXM4-80GB")
CPU = Target(platform="cpu", device_kind="cpu")
BASE = dict(d_model=128, d_ff=128, num_experts=8, top_k=2)


def _cfg(**changes) -> MoEConfig:
    return MoEConfig(**{**BASE, **changes})


@pytest.mark.parametrize(
    "target, changes, expected, why",
    [
        (H100, {}, "fused", "Hopper GPU"),
        (H200, {}, "fused", "Hopper GPU"),
        (H100, dict(exchange="ring"), "pallas", "exchange='ring'"),
        (H100, dict(dtype="float32"), "xla", "not dtype=float32"),
        (H100, dict(d_ff=96), "xla", "d_ff=96 to be a multiple of 64"),
        (A100, {}, "xla", "compute capability 8.0"),
        (CPU, {}, "xla", "a CPU device is no Hopper GPU"),
    ],
)
def test_auto_implementation(target, changes, expected, why):
    impl, reason = resolve_implementation(_cfg(**changes), target)
    assert impl == expected and why in reason


def test_explicit_implementation_is_kept_or_refused():
    assert resolve_implementation(_cfg(implementation="xla"), H100) == ("xla", "set")
    # On a CPU the kernels run in GPU interpret mode (the tests do).
    assert resolve_implementation(_cfg(implementation="fused"), CPU) == ("fused", "set")
    with pytest.raises(ValueError, match=r"'fused' runs Mosaic GPU kernels.*compute capability 8"):
        resolve_implementation(_cfg(implementation="fused"), A100)


def test_default_target_is_the_first_device():
    assert current_target().device_kind == jax.devices()[0].device_kind
    with targeting("NVIDIA H200") as target:
        assert current_target() == target == H200
    assert current_target().platform == "cpu"
    with pytest.raises(ValueError, match="is not one of the known GPUs"):
        gpu_target("NVIDIA B200")


def test_the_benchmark_shapes_on_the_h100():
    # qwen3_30b_a3b, mixtral_8x7b and the deepseek-v3 slice at 16,384 tokens: every kept gate/up
    # fits 1/16 of 80 GiB.
    for name in ("qwen3_30b_a3b", "mixtral_8x7b", "deepseek_v3"):
        res = resolve(presets[name], num_tokens=16384, target=H100)
        options = res.config.options
        assert res.config.implementation == "fused", name
        assert (options.token_chunk, options.rows) == (GPU_TOKEN_CHUNK, "copied"), name
        assert (options.residuals, options.recompute) == ("gate_up", "gmm"), name
        assert options.exchange_tile == "auto"  # no mesh: the exchange's options do not apply


def test_residuals_follow_their_bytes():
    cfg = presets["mixtral_8x7b"]
    share = int(RESIDUAL_SHARE * H100.memory_bytes)
    fits = share // residual_bytes(cfg, 1)
    assert resolve(cfg, num_tokens=fits, target=H100).config.options.residuals == "gate_up"
    res = resolve(cfg, num_tokens=fits + 1, target=H100)
    assert res.config.options.residuals == "inputs"
    assert "GiB to keep, > 1/16 of 80.00 GiB" in res.reasons["residuals"]
    unknown = dataclasses.replace(H100, memory_bytes=None)
    assert resolve(cfg, num_tokens=8, target=unknown).config.options.residuals == "inputs"
    # A recompute set by hand asks for recomputation.
    kernel = dataclasses.replace(cfg, options=MoEOptions(recompute="kernel"))
    assert resolve(kernel, num_tokens=8, target=H100).config.options.residuals == "inputs"


def test_token_chunk_follows_the_target_only():
    cfg = _cfg(row_tile=32)
    assert resolve(cfg, num_tokens=64, target=CPU).config.options.token_chunk == 256
    assert resolve(cfg, num_tokens=64, target=A100).config.options.token_chunk == 2048
    set_ = dataclasses.replace(cfg, options=MoEOptions(token_chunk=24))
    res = resolve(set_, num_tokens=64, target=H100)
    assert res.config.options.token_chunk == 24 and res.reasons["token_chunk"] == "set"


def test_exchange_options_under_an_expert_axis():
    res = resolve(_cfg(), num_tokens=4096, meshed=True, expert_devices=8, target=H200)
    options = res.config.options
    assert res.config.implementation == "fused"
    assert options.residuals == "inputs"  # the exchange's backward recomputes each round
    assert options.exchange_tile == 64 and options.exchange_fusion == "per_gemm"
    from pallas_kernels.exchange import tuning

    assert options.exchange_programs == tuning.EXCHANGE_PROGRAMS["NVIDIA H200"]
    assert options.is_resolved()


@pytest.mark.parametrize(
    "changes, context, message",
    [
        (dict(options=MoEOptions(rows="gathered")), dict(meshed=True), "cannot run under a mesh"),
        (
            dict(options=MoEOptions(residuals="gate_up")),
            dict(meshed=True, expert_devices=2),
            "residuals='gate_up' cannot run with the in-kernel exchange",
        ),
        (
            dict(options=MoEOptions(residuals="gate_up", exchange_on_one_device=True)),
            dict(meshed=True, expert_devices=1),
            "residuals='gate_up' cannot run with the in-kernel exchange",
        ),
        (
            dict(options=MoEOptions(residuals="gate_up", recompute="kernel")),
            {},
            "recompute='kernel' applies to residuals 'inputs' only",
        ),
        (
            dict(num_experts=320, options=MoEOptions(router="kernel")),
            {},
            "router='kernel' takes at most 256 experts",
        ),
        (
            dict(d_model=192, options=MoEOptions(exchange_fusion="forward")),
            dict(meshed=True, expert_devices=2),
            "d_model=192 to be a multiple of 128",
        ),
    ],
)
def test_requests_that_cannot_be_honoured_raise(changes, context, message):
    context = {"target": H100, **context}
    with pytest.raises(ValueError, match=message):
        resolve(_cfg(**changes), num_tokens=4096, **context)


def test_options_for_parts_that_do_not_run_here_wait_for_where_they_do():
    # One config for a laptop and a GPU, one device and an expert axis of 8: `fused`'s options
    # under "auto" on a CPU, the exchange's without a mesh. The report lists what applies.
    options = MoEOptions(residuals="inputs", exchange_tile=16, exchange_programs=8)
    cfg = _cfg(options=options)
    on_cpu = resolve(cfg, num_tokens=4096, target=CPU)
    assert on_cpu.config.implementation == "xla"
    assert on_cpu.config.options == MoEOptions(token_chunk=512)  # xla takes no other
    assert set(on_cpu.reasons) == {"implementation", "token_chunk"}
    one_gpu = resolve(cfg, num_tokens=4096, target=H100)
    assert "exchange_tile" not in one_gpu.reasons and one_gpu.reasons["residuals"] == "set"
    ep8 = resolve(cfg, num_tokens=4096, meshed=True, expert_devices=8, target=H100)
    assert ep8.reasons["exchange_tile"] == ep8.reasons["exchange_programs"] == "set"
    assert (ep8.config.options.exchange_tile, ep8.config.options.exchange_programs) == (16, 8)


def test_the_option_literals_are_the_kernels():
    from pallas_kernels.exchange import ops as exchange_ops
    from pallas_kernels.grouped_matmul import ops as gmm_ops

    assert options.EXCHANGE_FUSIONS == exchange_ops.EXCHANGE_FUSIONS
    assert options.RECOMPUTES == gmm_ops.RECOMPUTES


def test_report_says_each_choice_and_why():
    res = resolve(presets["qwen3_30b_a3b"], num_tokens=16384, target=H100)
    report = res.report().splitlines()
    assert report[0].startswith("implementation = 'fused': Hopper GPU (NVIDIA H100 80GB HBM3)")
    assert [line.split(" = ")[0] for line in report] == [
        "implementation",
        "token_chunk",
        "rows",
        "recompute",
        "router",
        "residuals",
    ]
    assert res.summary() == (
        "MoE 'fused' (token_chunk=2048, rows='copied', residuals='gate_up', recompute='gmm', "
        "router='xla')"
    )


# The bits contract: the choices that change last bits (implementation, token_chunk, recompute,
# router) depend on the config and the target, never on the mesh or the token count.
BITS_KNOBS = ("implementation", "token_chunk", "recompute", "router")


@pytest.mark.parametrize("target", [H100, H200, A100, CPU], ids=lambda t: t.device_kind)
@pytest.mark.parametrize("name", ["qwen3_30b_a3b", "mixtral_8x7b", "deepseek_v3", "tiny"])
def test_bit_changing_choices_ignore_mesh_and_tokens(target, name):
    cfg = presets[name]
    seen = set()
    for tokens, (meshed, ep) in itertools.product(
        (8, 512, 16384, 2**20), ((False, 1), (True, 1), (True, 2), (True, 8), (True, 72))
    ):
        config = resolve(cfg, num_tokens=tokens, meshed=meshed, expert_devices=ep, target=target)
        config = config.config
        values = {"implementation": config.implementation, **dataclasses.asdict(config.options)}
        seen.add(tuple(values[k] for k in BITS_KNOBS))
    assert len(seen) == 1, seen


@pytest.mark.slow
def test_defaults_lower_to_the_mosaic_gpu_kernels_for_cuda():
    # MoEConfig with nothing else: on a CPU it runs xla; built for an H100 (lowered for CUDA on
    # this CPU machine), the forward and backward are the Mosaic GPU kernels.
    cfg = MoEConfig(**BASE)
    params = mok_jax.init_params(jax.random.key(0), cfg)
    x = jnp.ones((256, BASE["d_model"]), jnp.bfloat16)

    def grad():  # a fresh function for each target: jit caches traces by function
        def loss(x, params):
            return mok_jax.moe(x, params, cfg)[0].astype(jnp.float32).sum()

        return jax.jit(jax.grad(loss, argnums=(0, 1)))

    assert "mosaic_gpu" not in grad().trace(x, params).lower().as_text()
    with targeting("NVIDIA H100 80GB HBM3"):
        lowered = grad().trace(x, params).lower(lowering_platforms=("cuda",))
    # The forward's gate/up and down kernels, and the backward's.
    assert lowered.as_text().count("mosaic_gpu") >= 4


def test_the_router_kernel_lowers_for_cuda_without_scatter_adds():
    # router="kernel", built for an H100: two more Mosaic GPU kernels than "xla" (the router's
    # forward and backward), and no scatter-add anywhere (the plan's one scatter writes a
    # permutation).
    from tests.mok_jax.test_layer import scatter_combiners

    def lowered_text(router: str) -> str:
        cfg = MoEConfig(**BASE, options=MoEOptions(router=router))
        params = mok_jax.init_params(jax.random.key(0), cfg)
        x = jnp.ones((256, BASE["d_model"]), jnp.bfloat16)

        def loss(x, params):
            y, aux = mok_jax.moe(x, params, cfg)
            return y.astype(jnp.float32).sum() + aux.loss

        with targeting("NVIDIA H100 80GB HBM3"):
            grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
            return grad.trace(x, params).lower(lowering_platforms=("cuda",)).as_text()

    kernel, xla = lowered_text("kernel"), lowered_text("xla")
    calls = "custom_call @mosaic_gpu"
    assert kernel.count(calls) == xla.count(calls) + 2
    assert not [c for c in scatter_combiners(kernel) if "add" in c]
