"""Device meshes for the MoE layer and the sharding rules that place its arrays on them.

A mesh has two axes: `data` and `expert`. Tokens are sharded over both (device (i, j) holds the
(i * EP + j)-th block of tokens), routed experts over `expert` (device j holds experts
[j*G, (j+1)*G)), and everything else is replicated. Named layouts:

  layout        shape (data x expert)  devices
  "expert"      1 x N                  all N devices (or `expert=`)
  "data_expert" D x E                  `data=` and/or `expert=`, the product of all devices
  "nvl72"       9 x 8                  a GB300 NVL72 rack: 72 GPUs
  "nvl72_ep72"  1 x 72                 the rack as one expert axis (E divisible by 72)
  "mok_ep64"    1 x 64                 MoK's benchmark layout: 64 of the rack's 72 GPUs

A CPU machine simulates a rack with XLA_FLAGS=--xla_force_host_platform_device_count=72.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from typing import Literal

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mok_jax.config import MoEConfig

Layout = Literal["expert", "data_expert", "nvl72", "nvl72_ep72", "mok_ep64"]
LAYOUTS: tuple[str, ...] = typing.get_args(Layout)
MESH_AXES = ("data", "expert")

_RACK_SHAPES = {"nvl72": (9, 8), "nvl72_ep72": (1, 72), "mok_ep64": (1, 64)}


def _mesh_shape(layout: str, num_devices: int, data: int | None, expert: int | None):
    if layout in _RACK_SHAPES:
        if data is not None or expert is not None:
            raise ValueError(
                f"layout={layout!r} has a fixed shape {_RACK_SHAPES[layout]}: omit data/expert"
            )
        return _RACK_SHAPES[layout]
    if layout == "expert":
        if data not in (None, 1):
            raise ValueError(f"layout='expert' is 1 x N: {data=} must be 1 or None")
        return 1, expert or num_devices
    if layout == "data_expert":
        if data is None and expert is None:
            raise ValueError("layout='data_expert' needs data= or expert= (or both)")
        # One degree given: the other is derived so that data x expert = every device.
        for name, given in (("data", data), ("expert", expert)):
            if given is not None and (data is None or expert is None) and num_devices % given:
                raise ValueError(
                    f"{name}={given} must divide the {num_devices} devices: layout="
                    f"'data_expert' given one degree makes data x expert = all {num_devices}"
                )
        if data is None:
            data = num_devices // expert
        if expert is None:
            expert = num_devices // data
        return data, expert
    raise ValueError(f"layout={layout!r} must be one of {LAYOUTS}")


def make_mesh(
    layout: Layout = "expert",
    *,
    data: int | None = None,
    expert: int | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A (`data`, `expert`) mesh in a named layout, on the first devices it needs.

    Args:
      layout: "expert", "data_expert", "nvl72", "nvl72_ep72" or "mok_ep64" (see the module).
      data: the data-parallel degree ("data_expert"; derived from `expert` when None).
      expert: the expert-parallel degree EP ("expert", "data_expert"; derived when None).
      devices: the devices to use, in order (default: `jax.devices()`).

    Returns:
      A `jax.sharding.Mesh` with axes ("data", "expert") (Explicit axis types, jax's default).

    Raises:
      ValueError: an unknown layout, degrees that do not fit, or too few devices.

    Example:
      >>> mesh = make_mesh("data_expert", data=2)      # on 8 devices: 2 x 4
      >>> dict(mesh.shape)
      {'data': 2, 'expert': 4}
    """
    devices = list(jax.devices() if devices is None else devices)
    for name, value in (("data", data), ("expert", expert)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{name}={value!r} must be a positive int")
    shape = _mesh_shape(layout, len(devices), data, expert)
    needed = shape[0] * shape[1]
    if needed > len(devices):
        raise ValueError(
            f"layout={layout!r} needs {shape[0]} x {shape[1]} = {needed} devices, "
            f"only {len(devices)} are available"
        )
    return jax.make_mesh(shape, MESH_AXES, devices=devices[:needed])


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingRules:
    """Logical axes -> mesh axes, as data. Logical axes: "tokens", "experts", "embed" (D),
    "mlp" (F and S*F), "router" (E of the router's columns). None: replicated.

    Attributes:
      tokens: the mesh axes tokens are sharded over, in order (must include `experts`).
      experts: the mesh axis routed experts are sharded over (the expert-parallel axis).
    """

    tokens: tuple[str, ...] = MESH_AXES
    experts: str = "expert"

    def __post_init__(self) -> None:
        if isinstance(self.tokens, str):
            object.__setattr__(self, "tokens", (self.tokens,))
        if self.experts not in self.tokens:
            raise ValueError(f"tokens={self.tokens} must include the expert axis {self.experts!r}")

    def mesh_axes(self, logical: str | None) -> str | tuple[str, ...] | None:
        return {"tokens": self.tokens, "experts": self.experts}.get(logical)

    def spec(self, *logical: str | None) -> PartitionSpec:
        """The PartitionSpec of an array whose dimensions have these logical axes."""
        return PartitionSpec(*(self.mesh_axes(name) for name in logical))

    def check(
        self, mesh: Mesh | jax.sharding.AbstractMesh, cfg: MoEConfig, num_tokens: int
    ) -> None:
        """Raises ValueError unless `mesh` can run `cfg` on `num_tokens` tokens."""
        names = tuple(mesh.axis_names)
        for axis in self.tokens:
            if axis not in names:
                raise ValueError(
                    f"the mesh has axes {names} but the sharding rules need {axis!r} "
                    "(use mok_jax.make_mesh, or ShardingRules naming your axes)"
                )
        ep = mesh.shape[self.experts]
        if cfg.num_experts % ep:
            raise ValueError(
                f"num_experts={cfg.num_experts} must be divisible by the expert-parallel degree "
                f"{ep} (mesh axis {self.experts!r})"
            )
        devices = 1
        for axis in self.tokens:
            devices *= mesh.shape[axis]
        if num_tokens % devices:
            raise ValueError(
                f"the {num_tokens} tokens must be divisible by the {devices} devices they are "
                f"sharded over (mesh axes {self.tokens})"
            )


# Logical axes of every MoEParams field.
PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "router": ("embed", "router"),
    "router_bias": ("router",),
    "w_gate": ("experts", "embed", "mlp"),
    "w_up": ("experts", "embed", "mlp"),
    "w_down": ("experts", "mlp", "embed"),
    "shared_w_gate": ("embed", "mlp"),
    "shared_w_up": ("embed", "mlp"),
    "shared_w_down": ("mlp", "embed"),
}


def param_specs(params, rules: ShardingRules | None = None):
    """The PartitionSpec of every field of a `MoEParams` (None where the field is None)."""
    rules = ShardingRules() if rules is None else rules
    return dataclasses.replace(
        params,
        **{
            field: None if getattr(params, field) is None else rules.spec(*PARAM_AXES[field])
            for field in PARAM_AXES
        },
    )


def shard_params(params, mesh: Mesh, rules: ShardingRules | None = None):
    """`params` placed on `mesh` as the layer wants them: experts over `expert`, the rest
    replicated. Placing once, before a jitted step, avoids a transfer at every call."""
    specs = param_specs(params, rules)
    return jax.tree.map(
        lambda a, s: None if a is None else jax.device_put(a, NamedSharding(mesh, s)),
        params,
        specs,
        is_leaf=lambda a: a is None,
    )


def shard_tokens(x_td: jax.Array, mesh: Mesh, rules: ShardingRules | None = None) -> jax.Array:
    """Tokens [T, D] placed on `mesh` as the layer wants them: T over (`data`, `expert`)."""
    rules = ShardingRules() if rules is None else rules
    return jax.device_put(x_td, NamedSharding(mesh, rules.spec("tokens", None)))
