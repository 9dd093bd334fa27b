"""bench/layer_profile on the CPU: stages read from op_name metadata, kernels charged to them."""

import jax
import jax.numpy as jnp
import pytest

from bench import layer_profile

HLO = """HloModule jit_fwd, entry_computation_layout={}
  %fusion.1 = f32[8]{0} fusion(f32[8]{0} %p), kind=kLoop, metadata={op_name="jit(f)/route/exp"}
  ROOT %custom-call.2 = f32[8] custom-call(%a), metadata={op_name="transpose(jvp(combine))/mul"}
  %copy.3 = f32[8]{0} copy(%b), metadata={op_name="jit(f)/routed_experts/neg"}
  %add.4 = f32[8]{0} add(%b, %b)
"""


def test_stages_come_from_the_op_names_and_their_transposes():
    stages = layer_profile.stage_of_instructions(HLO)
    assert stages == {"fusion.1": "route", "custom-call.2": "combine", "copy.3": "other"}
    ops = layer_profile.op_of_instructions(HLO, chars=8)
    assert ops == {"fusion.1": "oute/exp", "custom-call.2": "ne))/mul", "copy.3": "erts/neg"}


def test_profiled_calls_charge_their_kernels_to_the_named_stages():
    def fn(x):
        with jax.named_scope("route"):
            a = jnp.sin(x) @ x
        with jax.named_scope("combine"):
            return jnp.cos(a) @ a

    x = jnp.ones((128, 128), jnp.float32)
    result = layer_profile.profile_calls(fn, (x,), iters=2)
    assert result["iters"] == 2
    # Per call: the same kernels whatever the number of calls profiled.
    once = layer_profile.profile_calls(fn, (x,), iters=1)
    assert once["kernels_per_call"] == result["kernels_per_call"]
    assert {"route", "combine"} <= set(result["stages"])
    assert all(stage["kernels"] >= 1 for stage in result["stages"].values())
    assert result["kernels_per_call"] == sum(s["kernels"] for s in result["stages"].values())
    assert result["span_ms"] > 0
    # Every kernel is kept, with the jax operations it came from.
    assert len(result["kernels"]) >= len(result["top"])
    assert sum(k["count"] for k in result["kernels"]) == result["kernels_per_call"]


def test_the_table_shows_each_calls_kernel_time_once():
    record = {
        "shape": "s",
        "implementation": "pallas",
        "product": "forward",
        "iters": 3,
        "span_ms": 9.0,
        "kernel_ms": 6.0,  # per call already
        "kernels_per_call": 4,
        "stages": {"route": {"kernel_ms": 1.5, "kernels": 1}},
        "top": [],
    }
    row = layer_profile.render([record]).splitlines()[2]
    assert row.startswith("| s | pallas | default | forward | 9.000 | 6.000 | 4 | 1.500 (1) |"), row


def test_an_implementation_on_a_mesh_of_n_devices_keeps_the_tokens_a_device():
    """ "fused_mesh2": the layer under a 2-device expert mesh with twice the shape's tokens."""
    _, (x1, _) = layer_profile._layer("tiny", "fused_mesh1", "forward")
    _, (x2, _) = layer_profile._layer("tiny", "fused_mesh2", "forward")
    assert x2.shape[0] == 2 * x1.shape[0] == 2 * layer_profile.SHAPES["tiny"][1]
    with pytest.raises(ValueError, match="devices"):
        layer_profile._layer("tiny", f"fused_mesh{len(jax.devices()) + 1}", "forward")
