"""The kernels of pallas_kernels lowered for CUDA, each configuration's program hashed.

`NAMES` are the kernel configurations that the tests lower for CUDA (the grouped GEMM's forward
with each epilogue and tile layout, its dgrad, the weight gradient, the Triton fallback, the
exchange's kernels, and the differentiable ops that chain them, forward and backward), at
small shapes; `config(name)` builds one. `lowered_hash(name)` lowers it for CUDA on this CPU
machine and hashes its canonical text (`canonical_text`): the lowered StableHLO program
printed without source locations, each kernel's custom call carrying the sha256 of its kernel
module in place of the module's bytes, then those kernel modules (Mosaic GPU's or Triton's
MLIR, printed without source locations and without the count of kernels the process lowered
before). So a hash changes when a kernel, its launch (operands, results, aliases, barrier
flags), its name (its body function's, "anonymous" for a functools.partial) or the XLA
program around it changes; not with the repository's path, the lines the code sits on, the
names of the functions it calls, or what the process lowered before.

lowered_kernels.json holds the hashes of the kernels as committed; test_lowered_kernels.py
holds each configuration to it. The kernels are built for `tuning.TARGET_DEVICE_KIND`, a CPU
machine's target (on a GPU, the tiles and the grid would be that GPU's).

  python -m tests.pallas_kernels.lowered_kernels            # which hashes differ from the table
  python -m tests.pallas_kernels.lowered_kernels --write    # rewrite the table
  python -m tests.pallas_kernels.lowered_kernels --dump D [NAME ...]  # canonical texts into D
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    # The command line: 8 simulated CPU devices for the exchange's mesh, as tests/conftest.py
    # sets them for the tests (before jax initializes its backends).
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import json
import pathlib
import warnings
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.extend.mlir import ir
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P
from jaxlib.triton import dialect as triton_dialect

from pallas_kernels.exchange import Moves
from pallas_kernels.exchange import mosaic_gpu as exchange_kernels
from pallas_kernels.exchange import ops as exchange_ops
from pallas_kernels.grouped_matmul import mosaic_gpu, ops, triton, tuning
from pallas_kernels.grouped_matmul.mosaic_gpu_wgrad import tgmm
from pallas_kernels.grouped_matmul.tuning import TileConfig
from pallas_kernels.routing import mosaic_gpu as router
from pallas_kernels.routing.reference import RouterSpec

TABLE = pathlib.Path(__file__).with_suffix(".json")
COMMAND = "python -m tests.pallas_kernels.lowered_kernels --write"

S = jax.ShapeDtypeStruct
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32

# ----------------------------------------------------------------------------------------------
# The canonical text of a lowering.

MOSAIC_GPU_CALL = "mosaic_gpu_v2"
TRITON_CALL = "__gpu$xla.gpu.triton"
# Per kernel call: the backend config's entry with the kernel module's bytecode, and entries
# dropped (the hash of those bytes, which carry source locations).
_KERNEL_MODULES = {MOSAIC_GPU_CALL: ("module", ("kernel_hash",)), TRITON_CALL: ("ir", ())}
# A Mosaic GPU module's name for its debug dumps: the kernel's name and the count of kernels
# the process has lowered (which depends on what ran before).
_DUMP_BASENAME = "mosaic_gpu.dump_basename"


@contextlib.contextmanager
def _kernel_context(call_target: str) -> Iterator[ir.Context]:
    """A context that reads the kernel modules of `call_target`: Triton's in a context of its
    own with the Triton dialect (an op of an unregistered dialect keeps its source location in
    its properties); Mosaic GPU's, serialized (ops of the versioned dialect stable_mosaic_gpu,
    which nothing registers), in JAX's context with unregistered dialects allowed while it
    reads, as Mosaic GPU's own serialization pass does."""
    if call_target == TRITON_CALL:
        context = ir.Context()
        triton_dialect.register_dialect(context)
        with context:
            yield context
        return
    with mlir.make_ir_context() as context:
        mgpu.dialect.register_dialect(context)
        allowed = context.allow_unregistered_dialects
        context.allow_unregistered_dialects = True
        try:
            yield context
        finally:
            context.allow_unregistered_dialects = allowed


def _kernel_text(call_target: str, bytecode: bytes) -> str:
    """A kernel module's text without source locations or the process's kernel count."""
    with _kernel_context(call_target):
        module = ir.Module.parse(bytecode)
        attributes = module.operation.attributes
        if _DUMP_BASENAME in attributes:
            del attributes[_DUMP_BASENAME]
        return module.operation.get_asm(enable_debug_info=False)


def _custom_calls(operation) -> Iterator:
    """The stablehlo.custom_call ops under `operation`, in program order."""
    for region in operation.regions:
        for block in region.blocks:
            for op in block.operations:
                if op.operation.name == "stablehlo.custom_call":
                    yield op.operation
                yield from _custom_calls(op.operation)


def canonical_text(lowered: jax.stages.Lowered) -> str:
    """The lowered program without source locations, each kernel module replaced by its text's
    sha256 in its custom call, then the kernel modules' texts (module docstring)."""
    program = lowered.compiler_ir("stablehlo").operation.clone()  # edited below
    kernels = []
    for call in _custom_calls(program):
        target = ir.StringAttr(call.attributes["call_target_name"]).value
        if target not in _KERNEL_MODULES:
            continue
        module_key, dropped = _KERNEL_MODULES[target]
        config = ir.DictAttr(call.attributes["mhlo.backend_config"])
        text = _kernel_text(target, ir.StringAttr(config[module_key]).value_bytes)
        digest = text_hash(text)
        kernels.append(f"// kernel {len(kernels)}: {target} {digest}\n{text}")
        entries = {
            config[i].name: config[i].attr
            for i in range(len(config))
            if config[i].name not in dropped
        }
        entries[module_key] = ir.StringAttr.get(digest, program.context)
        call.attributes["mhlo.backend_config"] = ir.DictAttr.get(entries, program.context)
    if not kernels:
        raise ValueError("the lowering has no Mosaic GPU or Triton kernel")
    return "\n".join([program.get_asm(enable_debug_info=False), *kernels])


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ----------------------------------------------------------------------------------------------
# The configurations.


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """A kernel configuration: `fn` jitted on `args` (abstract), lowered for CUDA. `target`
    builds it for an abstract H200 (the Triton lowering reads the GPU's kind from the mesh)."""

    fn: Callable
    args: tuple[jax.ShapeDtypeStruct, ...]
    target: bool = False

    def lower(self) -> jax.stages.Lowered:
        with contextlib.ExitStack() as stack:
            if self.target:
                stack.enter_context(jax.sharding.use_abstract_mesh(_H200))
                stack.enter_context(warnings.catch_warnings())
                # The Pallas Triton backend's deprecation, which its lowering raises.
                warnings.filterwarnings(
                    "ignore", message=triton.LOWERING_WARNING, category=DeprecationWarning
                )
            return jax.jit(self.fn).trace(*self.args).lower(lowering_platforms=("cuda",))


_H200 = jax.sharding.AbstractMesh(
    (1,),
    ("x",),
    abstract_device=jax.sharding.AbstractDevice(
        device_kind=tuning.TARGET_DEVICE_KIND,
        num_cores=tuning.DEVICES[tuning.TARGET_DEVICE_KIND].num_cores,
        platform="gpu",
    ),
)

# Grouped GEMM shapes: M rows (a multiple of 8, and M_ODD not), K, N, G groups; F for SwiGLU.
M, M_ODD, K, N, G, F = 1024, 1021, 256, 512, 4, 256
# The layer's scaled-down presets (D = F = 64): the defaults narrowed to 64-column tiles.
D_SMALL = 64
# The ops' D and F: the layer's scaled-down presets' (their kernels' tiles at other shapes are
# the configurations of the kernels themselves).
D_OPS = D_SMALL


def _gmm(*, m=M, k=K, n=N, g=G, **kwargs) -> KernelConfig:
    """mosaic_gpu.gmm on lhs [m, k], rhs [g, k, n] ([g, n, k] with transpose_rhs)."""
    rhs = (g, n, k) if kwargs.get("transpose_rhs", False) else (g, k, n)
    return KernelConfig(
        fn=lambda a, b, s: mosaic_gpu.gmm(a, b, s, **kwargs),
        args=(S((m, k), BF16), S(rhs, BF16), S((g,), I32)),
    )


def _gmm_clusters(**cluster) -> KernelConfig:
    """gmm with clusters of CTAs, the rows split between the consumers."""
    config = dataclasses.replace(mosaic_gpu.default_config(n=N), consumer_dim="m", **cluster)
    return _gmm(config=config)


def _gmm_k_parts() -> KernelConfig:
    """The backward's [d_gate | d_up] @ [w_gate | w_up].T: the rhs in two parts along K."""
    return KernelConfig(
        fn=lambda a, b, c, s: mosaic_gpu.gmm(a, (b, c), s, transpose_rhs=True),
        args=(S((M, 2 * F), BF16), S((G, K, F), BF16), S((G, K, F), BF16), S((G,), I32)),
    )


def _gmm_row_scaled(*, gathered: bool = False) -> KernelConfig:
    """The weighted down projection: f32 out, each row times its scale; with `gathered`, the
    rows read from a [T, F] lhs through a row table."""
    if gathered:
        return KernelConfig(
            fn=lambda x, w, s, r, c: mosaic_gpu.gmm(
                x, w, s, lhs_rows_m=r, row_scale_m=c, out_dtype=F32
            ),
            args=(S((M // 4, F), BF16), S((G, F, K), BF16), S((G,), I32), S((M,), I32),
                  S((M,), F32)),
        )  # fmt: skip
    return KernelConfig(
        fn=lambda x, w, s, c: mosaic_gpu.gmm(x, w, s, row_scale_m=c, out_dtype=F32),
        args=(S((M, F), BF16), S((G, F, K), BF16), S((G,), I32), S((M,), F32)),
    )


def _gmm_swiglu(*, gathered: bool = False, **kwargs) -> KernelConfig:
    """mosaic_gpu.gmm_swiglu on lhs [M, K] (with `gathered`, [M / 4, K] through a row table)."""
    if gathered:
        return KernelConfig(
            fn=lambda x, a, b, s, r: mosaic_gpu.gmm_swiglu(x, a, b, s, lhs_rows_m=r, **kwargs),
            args=(S((M // 4, K), BF16), S((G, K, F), BF16), S((G, K, F), BF16), S((G,), I32),
                  S((M,), I32)),
        )  # fmt: skip
    return KernelConfig(
        fn=lambda x, a, b, s: mosaic_gpu.gmm_swiglu(x, a, b, s, **kwargs),
        args=(S((M, K), BF16), S((G, K, F), BF16), S((G, K, F), BF16), S((G,), I32)),
    )


def _gmm_swiglu_bwd(*, weighted: bool) -> KernelConfig:
    return KernelConfig(
        fn=lambda x, dy, a, b, c, s, w: mosaic_gpu.gmm_swiglu_bwd(
            x, dy, a, b, c, s, row_scale_m=w if weighted else None
        ),
        args=(S((M, K), BF16), S((M, K), BF16), S((G, K, F), BF16), S((G, K, F), BF16),
              S((G, F, K), BF16), S((G,), I32), S((M,), F32)),
    )  # fmt: skip


# tgmm's tiles as its tests set them.
_TGMM_SMALL = TileConfig(
    block_m=64,
    block_n=128,
    block_k=64,
    max_concurrent_steps=2,
    delay_release=0,
    epi_block_m=64,
    epi_block_n=32,
)


def _tgmm(*, m=M, k=K, n=N, g=G, **kwargs) -> KernelConfig:
    """mosaic_gpu_wgrad.tgmm on lhs [m, k], rhs [m, n]."""
    return KernelConfig(
        fn=lambda a, b, s: tgmm(a, b, s, **kwargs),
        args=(S((m, k), BF16), S((m, n), BF16), S((g,), I32)),
    )


def _triton(*, transpose_rhs: bool) -> KernelConfig:
    rhs = (G, N, K) if transpose_rhs else (G, K, N)
    return KernelConfig(
        fn=lambda a, b, s: triton.gmm(a, b, s, transpose_rhs=transpose_rhs),
        args=(S((M, K), BF16), S(rhs, BF16), S((G,), I32)),
        target=True,
    )


# The differentiable ops: the forward and the backward (one cotangent), in one program.


def _with_vjp(op: Callable, num_diff: int) -> Callable:
    """(*args, cotangent) -> (op(*args), the gradients of its first `num_diff` args)."""

    def fn(*args):
        *operands, cotangent = args
        diff, rest = operands[:num_diff], operands[num_diff:]
        out, vjp = jax.vjp(lambda *d: op(*d, *rest), *diff)
        return out, vjp(cotangent)

    return fn


def _ops_gmm(**kwargs) -> KernelConfig:
    """ops.gmm on x [M, D], w [G, D, D] (transposed or not)."""
    return KernelConfig(
        fn=_with_vjp(lambda a, b, s: ops.gmm(a, b, s, **kwargs), 2),
        args=(S((M, D_OPS), BF16), S((G, D_OPS, D_OPS), BF16), S((G,), I32),
              S((M, D_OPS), BF16)),
    )  # fmt: skip


def _ops_gmm_scaled() -> KernelConfig:
    """ops.gmm with a row scale (f32 out; the scale gets a gradient too)."""
    return KernelConfig(
        fn=_with_vjp(lambda a, b, c, s: ops.gmm(a, b, s, row_scale_m=c), 3),
        args=(S((M, D_OPS), BF16), S((G, D_OPS, D_OPS), BF16), S((M,), F32), S((G,), I32),
              S((M, D_OPS), F32)),
    )  # fmt: skip


def _ops_gmm_swiglu() -> KernelConfig:
    w = S((G, D_OPS, D_OPS), BF16)
    return KernelConfig(
        fn=_with_vjp(ops.gmm_swiglu, 3),
        args=(S((M, D_OPS), BF16), w, w, S((G,), I32), S((M, D_OPS), BF16)),
    )


def _ops_swiglu_mlp(*, d=D_OPS, f=D_OPS, weighted: bool = True, recompute="gmm") -> KernelConfig:
    """ops.swiglu_mlp forward and backward: x [M, d], weights [G, d, f] and [G, f, d]."""
    weights = (S((G, d, f), BF16), S((G, d, f), BF16), S((G, f, d), BF16))
    if weighted:

        def op(x, a, b, c, w, s):
            return ops.swiglu_mlp(x, a, b, c, s, row_scale_m=w, recompute=recompute)

        args = (S((M, d), BF16), *weights, S((M,), F32), S((G,), I32), S((M, d), F32))
        return KernelConfig(fn=_with_vjp(op, 5), args=args)

    def op_unweighted(x, a, b, c, s):
        return ops.swiglu_mlp(x, a, b, c, s, recompute=recompute)

    args = (S((M, d), BF16), *weights, S((G,), I32), S((M, d), F32))
    return KernelConfig(fn=_with_vjp(op_unweighted, 4), args=args)


# The exchange: inside shard_map over AXIS on EP_DEVICES devices (8 simulated CPU devices),
# at its tests' sizes: N rows a device, G_LOCAL experts a device, a receive window of WINDOW
# rows in tiles of TILE, D and F. A device's copy tables come in as one int32 array
# (`_MovesShape.unpack`): the kernels read tables of the protocol's shapes
# (pallas_kernels/exchange/protocol.py's), whatever their values, so the test needs no protocol.
AXIS = "expert"
EP_DEVICES = 8
N_ROWS, G_LOCAL, WINDOW, TILE, D_MODEL, D_FF = 512, 4, 640, 64, 2048, 768
# The kernels' other variants (copy stages) and the ops, at a smaller D and F: the GEMM
# programs' tiles at the tests' sizes are the configurations above.
D_SMALL_EXCHANGE, D_FF_SMALL_EXCHANGE = 128, 64
NUM_TILES = -(-WINDOW // TILE) + G_LOCAL  # the buffer's tiles (a counter each)
SLOTS = NUM_TILES * TILE
# Zero ranges: the dispatch's, one a local expert plus the tail's (8); the return's, one.
DISPATCH_ZEROS, RETURN_ZEROS = G_LOCAL + 8, 1
PROGRAMS = 16  # exchange programs of the overlapped kernels, as the tests run them


@dataclasses.dataclass(frozen=True)
class _MovesShape:
    """The shapes of a device's `Moves`: P copies, C counters, Z zero ranges."""

    copies: int
    counters: int
    zeros: int

    @property
    def size(self) -> int:
        return 6 * self.copies + 1 + self.counters + 2 * self.zeros

    def unpack(self, table_l) -> Moves:
        """The `Moves` held in one int32 [size] array (copies' six columns, count, arrivals,
        zero ranges)."""
        p, c, z = self.copies, self.counters, self.zeros
        columns = [table_l[i * p : (i + 1) * p] for i in range(6)]
        return Moves(
            *columns,
            count=table_l[6 * p],
            arrivals_c=table_l[6 * p + 1 : 6 * p + 1 + c],
            zero_dst_z=table_l[6 * p + 1 + c : 6 * p + 1 + c + z],
            zero_size_z=table_l[6 * p + 1 + c + z :],
        )


# The dispatch: a copy a row at most, a counter a buffer tile. The return: every device's
# pieces to this one, one counter.
DISPATCH = _MovesShape(N_ROWS, NUM_TILES, DISPATCH_ZEROS)
BACK = _MovesShape(EP_DEVICES * N_ROWS, 1, RETURN_ZEROS)
# The return on a 1-device mesh: its own pieces only.
RETURN_ONE = _MovesShape(N_ROWS, 1, RETURN_ZEROS)


def _mesh(num_devices: int = EP_DEVICES) -> jax.sharding.Mesh:
    devices = jax.devices()
    if len(devices) < num_devices:
        raise RuntimeError(
            f"the exchange's configurations need {num_devices} devices, this process has "
            f"{len(devices)} (XLA_FLAGS=--xla_force_host_platform_device_count={num_devices})"
        )
    return jax.make_mesh((num_devices,), (AXIS,), devices=devices[:num_devices])


def _exchange(body: Callable, local: tuple, *, num_devices: int = EP_DEVICES) -> KernelConfig:
    """A KernelConfig of `body(*local, round_index)` inside shard_map: `local` the per-device
    arrays (their shapes on one device, split along AXIS), round_index int32 [] replicated;
    the outputs split along AXIS."""
    mesh = _mesh(num_devices)
    split = jax.NamedSharding(mesh, P(AXIS))
    args = tuple(
        S((num_devices * a.shape[0], *a.shape[1:]), a.dtype, sharding=split) for a in local
    )
    args += (S((), I32, sharding=jax.NamedSharding(mesh, P())),)
    specs = (P(AXIS),) * len(local) + (P(),)
    fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(AXIS))
    return KernelConfig(fn=fn, args=args)


def _tables(*shapes: _MovesShape) -> tuple[jax.ShapeDtypeStruct, ...]:
    return tuple(S((shape.size,), I32) for shape in shapes)


def _send_rows(*, copy_stages: int) -> KernelConfig:
    """The round's dispatch, then the return of the buffer (two send_rows kernels)."""
    send = functools.partial(exchange_kernels.send_rows, axis_name=AXIS, num_blocks=132,
                             copy_stages=copy_stages)  # fmt: skip

    def body(x, dispatch, back, round_index):
        buffer = send(x, DISPATCH.unpack(dispatch), round_index, out_rows=SLOTS)
        return buffer, send(buffer, BACK.unpack(back), round_index, out_rows=N_ROWS)

    return _exchange(body, (S((N_ROWS, D_MODEL), BF16), *_tables(DISPATCH, BACK)))


def _send_rows_on_one_device() -> KernelConfig:
    """The return on a 1-device mesh (the copies local), f32 rows."""

    def body(y, back, round_index):
        moves = RETURN_ONE.unpack(back)
        return exchange_kernels.send_rows(y, moves, round_index, out_rows=N_ROWS, axis_name=AXIS)

    return _exchange(body, (S((SLOTS, D_MODEL), F32), *_tables(RETURN_ONE)), num_devices=1)


def _dispatch_swiglu(*, copy_stages: int, d: int = D_MODEL, f: int = D_FF) -> KernelConfig:
    def body(x, side, w_gate, w_up, group_sizes, dispatch, round_index):
        return exchange_kernels.dispatch_swiglu(
            x, side, DISPATCH.unpack(dispatch), round_index, w_gate, w_up, group_sizes,
            out_rows=SLOTS, tile=TILE, axis_name=AXIS, exchange_programs=PROGRAMS,
            copy_stages=copy_stages,
        )  # fmt: skip

    weights = S((G_LOCAL, d, f), BF16)
    local = (S((N_ROWS, d), BF16), S((N_ROWS, 4), F32), weights, weights,
             S((G_LOCAL,), I32), *_tables(DISPATCH))  # fmt: skip
    return _exchange(body, local)


def _dispatch_down_grad(*, copy_stages: int, d: int = D_MODEL, f: int = D_FF) -> KernelConfig:
    """The backward's dispatch of dy with three sides (two bf16 [N, D] arrays and the
    weights), overlapped with g = dy @ w_down.T."""

    def body(w_down, group_sizes, dispatch, dy, side_a, side_b, weights, round_index):
        return exchange_kernels.dispatch_down_grad(
            dy, (side_a, side_b, weights), DISPATCH.unpack(dispatch), round_index, w_down,
            group_sizes, out_rows=SLOTS, tile=TILE, axis_name=AXIS,
            exchange_programs=PROGRAMS, copy_stages=copy_stages,
        )  # fmt: skip

    rows = S((N_ROWS, d), BF16)
    local = (S((G_LOCAL, f, d), BF16), S((G_LOCAL,), I32), *_tables(DISPATCH), rows,
             rows, rows, S((N_ROWS, 4), F32))  # fmt: skip
    return _exchange(body, local)


def _down_return(*, copy_stages: int, d: int = D_MODEL, f: int = D_FF) -> KernelConfig:
    def body(h, scale, w_down, group_sizes, back, round_index):
        return exchange_kernels.down_return(
            h, scale, w_down, group_sizes, BACK.unpack(back), round_index, out_rows=N_ROWS,
            axis_name=AXIS, exchange_programs=PROGRAMS, copy_stages=copy_stages,
        )  # fmt: skip

    local = (S((SLOTS, f), BF16), S((SLOTS,), F32), S((G_LOCAL, f, d), BF16),
             S((G_LOCAL,), I32), *_tables(BACK))  # fmt: skip
    return _exchange(body, local)


def _dgrad_return(*, d: int = D_MODEL, f: int = D_FF) -> KernelConfig:
    """The input gradient's GEMM and its return, with the routing weights' gradient."""

    def body(d_gate_up, w_gate, w_up, group_sizes, back, d_scale, round_index):
        return exchange_kernels.dgrad_return(
            d_gate_up, w_gate, w_up, group_sizes, BACK.unpack(back), round_index,
            sides=(d_scale,), out_rows=N_ROWS, axis_name=AXIS, exchange_programs=PROGRAMS,
        )  # fmt: skip

    weights = S((G_LOCAL, d, f), BF16)
    local = (S((SLOTS, 2 * f), BF16), weights, weights, S((G_LOCAL,), I32), *_tables(BACK),
             S((SLOTS, 4), F32))  # fmt: skip
    return _exchange(body, local)


def _dispatch_mlp_return(*, copy_stages: int, d: int = D_MODEL, f: int = D_FF) -> KernelConfig:
    """The round's whole forward in one kernel."""

    def body(x, side, w_gate, w_up, w_down, group_sizes, dispatch, back, round_index):
        return exchange_kernels.dispatch_mlp_return(
            x, side, DISPATCH.unpack(dispatch), BACK.unpack(back), round_index, w_gate, w_up,
            w_down, group_sizes, out_rows=SLOTS, tile=TILE, axis_name=AXIS,
            exchange_programs=PROGRAMS, copy_stages=copy_stages,
        )  # fmt: skip

    weights = S((G_LOCAL, d, f), BF16)
    local = (S((N_ROWS, d), BF16), S((N_ROWS, 4), F32), weights, weights,
             S((G_LOCAL, f, d), BF16), S((G_LOCAL,), I32),
             *_tables(DISPATCH, BACK))  # fmt: skip
    return _exchange(body, local)


def _copy_piece_pipelined() -> KernelConfig:
    """The pipelined copy in a kernel of its own (2 stages), as its lowering test builds it."""

    def copies(x_ref, src_ref, dst_ref, size_ref, out_ref, stage_smem, loaded):
        @pl.loop(0, 3)
        def _piece(p):
            exchange_kernels.copy_piece_pipelined(x_ref, out_ref, src_ref[p], dst_ref[p],
                                                  size_ref[p], stage_smem, loaded)  # fmt: skip

    kernel = plgpu.kernel(
        copies,
        out_type=S((256, 2048), BF16),
        scratch_types=[
            plgpu.SMEM((2, 8, 2048), BF16),
            plgpu.Barrier(num_arrivals=1, num_barriers=2),
        ],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    table = S((3,), I32)
    return KernelConfig(fn=kernel, args=(S((256, 2048), BF16), table, table, table))


def _ops_send_rows() -> KernelConfig:
    """ops.send_rows with the kernel: the dispatch forward, its gradient along the return."""

    def body(x, g, dispatch, back, round_index):
        def there(a):
            return exchange_ops.send_rows(a, DISPATCH.unpack(dispatch), BACK.unpack(back),
                                          round_index, SLOTS, AXIS, "mosaic_gpu")  # fmt: skip

        out, vjp = jax.vjp(there, x)
        return out, vjp(g)[0]

    local = (S((N_ROWS, D_MODEL), BF16), S((SLOTS, D_MODEL), BF16), *_tables(DISPATCH, BACK))
    return _exchange(body, local)


def _ops_dispatch_mlp(**kwargs) -> KernelConfig:
    """ops.dispatch_mlp's forward and backward (the layer's round with the in-kernel exchange):
    the gradients of x, the routing weights and the expert weights."""

    d, f = D_SMALL_EXCHANGE, D_FF_SMALL_EXCHANGE

    def body(x, scale, w_gate, w_up, w_down, group_sizes, dispatch, back, d_out, round_index):
        def mlp(x, scale, w_gate, w_up, w_down):
            return exchange_ops.dispatch_mlp(
                x, scale, DISPATCH.unpack(dispatch), BACK.unpack(back), round_index, w_gate,
                w_up, w_down, group_sizes, out_rows=SLOTS, tile=TILE, axis_name=AXIS, **kwargs,
            )  # fmt: skip

        out, vjp = jax.vjp(mlp, x, scale, w_gate, w_up, w_down)
        return out, vjp(d_out)

    weights = S((G_LOCAL, d, f), BF16)
    local = (S((N_ROWS, d), BF16), S((N_ROWS,), F32), weights, weights,
             S((G_LOCAL, f, d), BF16), S((G_LOCAL,), I32), *_tables(DISPATCH, BACK),
             S((N_ROWS, d), F32))  # fmt: skip
    return _exchange(body, local)


# The router's fullest spec: sigmoid scores, group-limited, normalized and scaled.
ROUTER_GROUPS = dict(
    top_k=6, score_fn="sigmoid", norm_topk_prob=True, routed_scaling=2.5, num_groups=8,
    topk_groups=4,
)  # fmt: skip


def _router(num_tokens: int, num_experts: int, **spec) -> KernelConfig:
    """The router's forward kernel on x [num_tokens, D_OPS] with num_experts experts."""
    router_spec = RouterSpec(num_experts=num_experts, **spec)
    return KernelConfig(
        fn=lambda x, w, b: router.route(x, w, b, router_spec),
        args=(S((num_tokens, D_OPS), BF16), S((D_OPS, num_experts), F32), S((num_experts,), F32)),
    )


def _router_backward(num_tokens: int, num_experts: int, **spec) -> KernelConfig:
    """The router's backward kernel, its cotangents those of the weights, lse and share sums."""
    router_spec = RouterSpec(num_experts=num_experts, **spec)
    k, tiles = router_spec.top_k, -(-num_tokens // router.TILE)
    return KernelConfig(
        fn=lambda x, w, e, dw, dl, ds: router.route_backward(x, w, e, (dw, dl, ds), router_spec),
        args=(S((num_tokens, D_OPS), BF16), S((D_OPS, num_experts), F32),
              S((num_tokens, k), I32), S((num_tokens, k), F32), S((num_tokens,), F32),
              S((tiles, num_experts), F32)),
    )  # fmt: skip


_CONFIGS: dict[str, Callable[[], KernelConfig]] = {
    # The grouped GEMM's forward (mosaic_gpu.gmm): the default tiles, a bf16 and an f32 output.
    "gmm/plain": lambda: _gmm(),
    "gmm/rows_not_a_multiple_of_8": lambda: _gmm(m=M_ODD),
    "gmm/f32_out": lambda: _gmm(out_dtype=F32),
    # Epilogues: the row scale (f32), SwiGLU (gate and up in one kernel), its backward.
    "gmm/row_scaled": lambda: _gmm_row_scaled(),
    "gmm/row_scaled_gathered_rows": lambda: _gmm_row_scaled(gathered=True),
    "gmm_swiglu/plain": lambda: _gmm_swiglu(),
    "gmm_swiglu/gate_up_out": lambda: _gmm_swiglu(gate_up_out=True),
    "gmm_swiglu/gathered_rows": lambda: _gmm_swiglu(gathered=True),
    "gmm_swiglu_bwd/weighted": lambda: _gmm_swiglu_bwd(weighted=True),
    "gmm_swiglu_bwd/unweighted": lambda: _gmm_swiglu_bwd(weighted=False),
    # dgrad: the transposed rhs, and the rhs in two parts along K.
    "gmm_dgrad/plain": lambda: _gmm(transpose_rhs=True),
    "gmm_dgrad/rhs_k_parts": _gmm_k_parts,
    # Tile layouts: clusters (rows split between the consumers), a ring of 2 stages each
    # released without delay, the interpret tests' tiles, the defaults narrowed to N = 64 (one
    # consumer; the layer's scaled-down presets).
    "gmm_tiles/cluster_n": lambda: _gmm_clusters(cluster_n=2),
    "gmm_tiles/cluster_m": lambda: _gmm_clusters(cluster_m=2),
    "gmm_tiles/cluster_2x2": lambda: _gmm_clusters(cluster_m=2, cluster_n=2),
    "gmm_tiles/ring_2_stages_no_delay": lambda: _gmm(
        config=dataclasses.replace(
            mosaic_gpu.default_config(n=N), max_concurrent_steps=2, delay_release=0
        )
    ),
    "gmm_tiles/interpret_tiles": lambda: _gmm(config=tuning.INTERPRET_CONFIG),
    "gmm_tiles/narrow_n64": lambda: _gmm(k=D_SMALL, n=D_SMALL),
    "gmm_swiglu_tiles/narrow_f64": lambda: KernelConfig(
        fn=mosaic_gpu.gmm_swiglu,
        args=(
            S((M, D_SMALL), BF16),
            S((G, D_SMALL, D_SMALL), BF16),
            S((G, D_SMALL, D_SMALL), BF16),
            S((G,), I32),
        ),
    ),
    "gmm_swiglu_tiles/interpret_tiles": lambda: _gmm_swiglu(config=tuning.INTERPRET_CONFIG),
    # The weight gradient (mosaic_gpu_wgrad.tgmm): its tests' tiles and outputs.
    "tgmm/plain": lambda: _tgmm(),
    "tgmm/bf16_out": lambda: _tgmm(out_dtype=BF16),
    "tgmm/out_parts_2": lambda: _tgmm(out_parts=2),
    "tgmm/rows_not_a_multiple_of_8": lambda: _tgmm(m=37, k=64, n=128, g=3, config=_TGMM_SMALL),
    "tgmm/block_128x256_no_delay": lambda: _tgmm(
        config=TileConfig(block_m=128, block_n=256, max_concurrent_steps=3, delay_release=0)
    ),
    "tgmm/delay_grid_tile_width_3": lambda: _tgmm(
        k=512,
        n=1024,
        config=TileConfig(
            block_n=256,
            max_concurrent_steps=3,
            delay_release=1,
            grid_minor_dim="m",
            grid_tile_width=3,
        ),
    ),
    "tgmm/cluster_m": lambda: _tgmm(
        config=TileConfig(block_n=256, max_concurrent_steps=3, cluster_m=2)
    ),
    # The Triton fallback.
    "triton_gmm/plain": lambda: _triton(transpose_rhs=False),
    "triton_gmm/transposed": lambda: _triton(transpose_rhs=True),
    # The differentiable ops (ops.py), forward and backward, at D = F = 64: which kernels they
    # chain, with the defaults' tiles, and the XLA between them.
    "ops/gmm": lambda: _ops_gmm(),
    "ops/gmm_transposed": lambda: _ops_gmm(transpose_rhs=True),
    "ops/gmm_row_scaled": _ops_gmm_scaled,
    "ops/gmm_swiglu": _ops_gmm_swiglu,
    "ops/swiglu_mlp": lambda: _ops_swiglu_mlp(),
    "ops/swiglu_mlp_unweighted": lambda: _ops_swiglu_mlp(weighted=False),
    "ops/swiglu_mlp_recompute_kernel": lambda: _ops_swiglu_mlp(recompute="kernel"),
    # The exchange's kernels inside shard_map on 8 devices: each at its tests' sizes, its other
    # copy stages at a smaller D and F.
    "exchange/send_rows": lambda: _send_rows(copy_stages=1),
    "exchange/send_rows_2_copy_stages": lambda: _send_rows(copy_stages=2),
    "exchange/send_rows_4_copy_stages": lambda: _send_rows(copy_stages=4),
    "exchange/send_rows_one_device": _send_rows_on_one_device,
    "exchange/copy_piece_pipelined": _copy_piece_pipelined,
    "exchange/dispatch_swiglu": lambda: _dispatch_swiglu(copy_stages=1),
    "exchange/dispatch_swiglu_2_copy_stages": lambda: _dispatch_swiglu(
        copy_stages=2, d=D_SMALL_EXCHANGE, f=D_FF_SMALL_EXCHANGE
    ),
    "exchange/dispatch_swiglu_4_copy_stages": lambda: _dispatch_swiglu(
        copy_stages=4, d=D_SMALL_EXCHANGE, f=D_FF_SMALL_EXCHANGE
    ),
    "exchange/down_return": lambda: _down_return(copy_stages=1),
    "exchange/down_return_2_copy_stages": lambda: _down_return(
        copy_stages=2, d=D_SMALL_EXCHANGE, f=D_FF_SMALL_EXCHANGE
    ),
    "exchange/down_return_4_copy_stages": lambda: _down_return(
        copy_stages=4, d=D_SMALL_EXCHANGE, f=D_FF_SMALL_EXCHANGE
    ),
    "exchange/dispatch_down_grad": lambda: _dispatch_down_grad(copy_stages=1),
    "exchange/dispatch_down_grad_4_copy_stages": lambda: _dispatch_down_grad(
        copy_stages=4, d=D_SMALL_EXCHANGE, f=D_FF_SMALL_EXCHANGE
    ),
    "exchange/dgrad_return": _dgrad_return,
    "exchange/dispatch_mlp_return": lambda: _dispatch_mlp_return(copy_stages=1),
    "exchange/dispatch_mlp_return_4_copy_stages": lambda: _dispatch_mlp_return(
        copy_stages=4, d=D_SMALL_EXCHANGE, f=D_FF_SMALL_EXCHANGE
    ),
    # The exchange's differentiable ops, forward and backward (D 128, F 64): the in-kernel
    # exchange per GEMM, the forward in one kernel, the copies in kernels of their own, the
    # backward's first GEMM recomputing gate and up ("kernel").
    "exchange_ops/send_rows": _ops_send_rows,
    "exchange_ops/dispatch_mlp_per_gemm": lambda: _ops_dispatch_mlp(exchange_programs=PROGRAMS),
    "exchange_ops/dispatch_mlp_forward_fusion": lambda: _ops_dispatch_mlp(
        exchange_programs=PROGRAMS, exchange_fusion="forward"
    ),
    "exchange_ops/dispatch_mlp_separate_kernels": lambda: _ops_dispatch_mlp(exchange_programs=0),
    "exchange_ops/dispatch_mlp_recompute_kernel": lambda: _ops_dispatch_mlp(
        exchange_programs=PROGRAMS, recompute="kernel"
    ),
    # The router's forward and backward: softmax top-k; sigmoid with groups, normalized and
    # scaled, over a partial last tile and experts padded to the column grain.
    "router/softmax": lambda: _router(256, 64, top_k=4),
    "router/sigmoid_groups": lambda: _router(200, 96, **ROUTER_GROUPS),
    "router/backward_softmax": lambda: _router_backward(256, 64, top_k=4),
    "router/backward_sigmoid_groups": lambda: _router_backward(200, 96, **ROUTER_GROUPS),
}
NAMES: tuple[str, ...] = tuple(_CONFIGS)


def config(name: str) -> KernelConfig:
    """The configuration `name` (built when asked: the exchange's need the devices)."""
    return _CONFIGS[name]()


def lowered_text(name: str) -> str:
    """The canonical text of configuration `name`'s lowering."""
    return canonical_text(config(name).lower())


def lowered_hash(name: str) -> str:
    """The sha256 of configuration `name`'s canonical text."""
    return text_hash(lowered_text(name))


def read_table() -> dict[str, str]:
    return json.loads(TABLE.read_text())


def write_table(hashes: dict[str, str]) -> None:
    TABLE.write_text(json.dumps(hashes, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {TABLE.name}")
    parser.add_argument("--dump", type=pathlib.Path, help="write each canonical text here")
    parser.add_argument("names", nargs="*", help="configurations (default: all)")
    args = parser.parse_args(argv)
    jax.config.update("jax_numpy_dtype_promotion", "strict")  # as the tests run
    unknown = sorted(set(args.names) - set(NAMES))
    if unknown:
        parser.error(f"no configurations {unknown}")
    names = args.names or list(NAMES)
    if args.write and args.names:
        parser.error("--write rewrites the whole table: give no names")
    table = read_table() if TABLE.exists() else {}
    hashes, changed = {}, []
    for name in names:
        text = lowered_text(name)
        hashes[name] = text_hash(text)
        if args.dump:
            path = args.dump / f"{name}.mlir"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        if table.get(name) != hashes[name]:
            changed.append(name)
        print(f"{'CHANGED' if name in changed else 'same':8} {name} {hashes[name]}", flush=True)
    if args.write:
        write_table(hashes)
        print(f"wrote {len(hashes)} hashes to {TABLE}")
        return 0
    stale = sorted(set(table) - set(NAMES))
    for name in stale:
        print(f"STALE    {name} (in {TABLE.name}, not a configuration)")
    return 1 if changed or stale else 0


if __name__ == "__main__":
    sys.exit(main())
