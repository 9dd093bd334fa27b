"""The router's forward and backward as Mosaic GPU kernels (Hopper, sm90): a program per tile
of tokens.

  route(x [T, D] bf16, router [D, E] f32, bias [E]) -> reference.Routed
  route_backward(x, router, experts [T, K], cotangents) -> (dx [T, D], d_logits [T, E] f32)

Program u owns tokens [u * TILE, (u + 1) * TILE) and runs, in registers:

  logits   wgmma of the x tile with the router's three bf16 pieces, K steps over D   [TILE, E']
  scores   softmax or sigmoid over the E real columns; lse
  select   the group mask, then K rounds of (row max, lowest column holding it)
  weights  each chosen column's score, normalized in slot order, scaled
  sums     the tile's counts and score shares per expert (column sums over its real tokens)

E' is E rounded up to a multiple of 64 (wgmma's and the swizzle's column grain); the padded
columns are never chosen and are sliced off. T is padded to whole tiles with zero tokens, which
are routed like any token, left out of the tile's sums and sliced off.

Invariants (numbered; the tests check each):
  1. Full f32 logits from bf16 products: the router's f32 weights are split into three bf16
     pieces, hi + mid + lo (each the rounding of what the ones before it left), which hold an
     f32 value's 24 significant bits exactly except where the pieces fall below bf16's normal
     range. A bf16 token times a bf16 piece is exact in f32, and wgmma accumulates every product
     in f32, so the logits are f32 dot products of x with the router, in the kernel's own
     summation order (the reference's values within f32 rounding; no TF32).
  2. A token's results depend on its own row only: every tile runs the same K steps into one
     f32 accumulator in the same order (no split-K, no atomics), and every later stage is a
     row-wise computation of the tile; so a token's experts, weights and lse are the same bits
     in any tile, at any T and on any mesh.
  3. Selection is the reference's rule for finite scores: round j takes the row's largest
     remaining biased score and, among equal ones, the lowest column, then removes it; columns
     outside the eligible groups and the padded columns start removed (-inf). A row with a
     NaN or infinite logit, score or bias is routed to unspecified experts (the GPU's row
     maximum propagates NaN, XLA:CPU's need not), each index clamped to E - 1 so that it stays
     a valid expert; its weights and lse follow the arithmetic (a training run's NaN check
     stops there).
  4. Each output element has one writer: program u writes columns [u * TILE, (u + 1) * TILE) of
     the [K, T'] experts and weights, those rows of the logits and lse, and row u of the sums.
  5. The tile's sums run over its real tokens only (row < T), as one column reduction of the
     tile in a fixed order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import Array, lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mesh import like
from pallas_kernels.routing.reference import Routed, RouterSpec

TILE = 64  # tokens per program: the rows of one warpgroup's wgmma
BLOCK_K = 64  # D per pipeline step: one 128-byte swizzled row of bf16
COLUMN_GRAIN = 64  # E is padded to a multiple of this
MAX_EXPERTS = 256  # wgmma's widest N
STAGES = 2
PIECES = 3  # bf16 pieces of the f32 router (invariant 1)
INPUT_DTYPE = jnp.dtype(jnp.bfloat16)
_ROW = plgpu.Layout.WGMMA.reduce(1)  # a [TILE] vector, one value per row
_COLUMN = plgpu.Layout.WGMMA.reduce(0)  # an [E'] vector, one value per column


def padded_experts(num_experts: int) -> int:
    """E', the kernel's columns: E rounded up to a multiple of COLUMN_GRAIN."""
    return -(-num_experts // COLUMN_GRAIN) * COLUMN_GRAIN


def router_pieces(router_de: Array, columns: int) -> Array:
    """bf16 [PIECES, D, columns]: hi, mid and lo with hi + mid + lo = router (invariant 1), the
    columns past E zero."""
    stacked = jnp.stack(split(router_de.astype(jnp.float32)))
    return jnp.pad(stacked, ((0, 0), (0, 0), (0, columns - router_de.shape[1])))


def split(value: Array) -> list[Array]:
    """Three bf16 pieces of an f32 array, hi + mid + lo = value (invariant 1): an XLA array
    or a kernel's register array."""
    pieces, rest = [], value
    for _ in range(PIECES):
        piece = rest.astype(jnp.bfloat16)
        rest = rest - piece.astype(jnp.float32)
        pieces.append(piece)
    return pieces


def check_inputs(x_td: Array, router_de: Array, bias_e: Array, spec: RouterSpec) -> None:
    """Raises ValueError for inputs the kernel does not take."""
    if x_td.ndim != 2 or jnp.dtype(x_td.dtype) != INPUT_DTYPE:
        raise ValueError(f"x must be bf16 [T, D], got {x_td.dtype} {x_td.shape}")
    num_tokens, d = x_td.shape
    if router_de.shape != (d, spec.num_experts):
        raise ValueError(f"router {router_de.shape} must be [D, E] = {(d, spec.num_experts)}")
    if bias_e.shape != (spec.num_experts,):
        raise ValueError(f"bias {bias_e.shape} must be [E] = ({spec.num_experts},)")
    if d % BLOCK_K:
        raise ValueError(f"D = {d} must be a multiple of {BLOCK_K}")
    if spec.num_experts > MAX_EXPERTS:
        raise ValueError(f"E = {spec.num_experts} must be at most {MAX_EXPERTS}")
    if num_tokens == 0:
        raise ValueError("no tokens to route")


# ----------------------------------------------------------------------------------------------
# The stages of a program, on register arrays of the tile ([TILE, E'] in the wgmma layout).


def _swizzled() -> tuple:
    return (plgpu.TilingTransform((8, BLOCK_K)), plgpu.SwizzleTransform(128))


def _logits(x_ref, pieces_ref, u) -> Array:
    """f32 [TILE, E']: the tile's logits (invariants 1, 2)."""
    d, columns = pieces_ref.shape[1], pieces_ref.shape[2]
    x_spec = plgpu.BlockSpec((TILE, BLOCK_K), lambda k: (u, k), transforms=_swizzled())
    piece_specs = [
        plgpu.BlockSpec(
            (None, BLOCK_K, columns), functools.partial(_piece_block, p), transforms=_swizzled()
        )
        for p in range(PIECES)
    ]

    def scope(acc_ref):
        def step(_, x_smem, *piece_smems):
            for piece_smem in piece_smems:
                plgpu.wgmma(acc_ref, x_smem, piece_smem)
            plgpu.wgmma_wait(0)

        pipeline = plgpu.emit_pipeline(
            step, grid=(d // BLOCK_K,), in_specs=[x_spec, *piece_specs], max_concurrent_steps=STAGES
        )
        pipeline(x_ref, *(pieces_ref,) * PIECES)
        return acc_ref[...]

    return pl.run_scoped(scope, plgpu.ACC((TILE, columns)))


def _piece_block(piece: int, k):
    return (piece, k, 0)


def _rows(v: Array, shape) -> Array:
    """A [TILE] row vector broadcast over the columns."""
    return lax.broadcast_in_dim(v, shape, [0])


def _columns(v: Array, shape) -> Array:
    """An [E'] column vector broadcast over the rows."""
    return lax.broadcast_in_dim(v, shape, [1])


def _scores(logits, real, spec: RouterSpec) -> tuple[Array, Array]:
    """(scores [TILE, E'], lse [TILE]): the padded columns' scores are 0."""
    shape = logits.shape
    masked = jnp.where(real, logits, -jnp.inf)
    top = masked.max(axis=1)
    exps = jnp.exp(masked - _rows(top, shape))
    total = exps.sum(axis=1)
    lse = top + jnp.log(total)
    if spec.score_fn == "softmax":
        return exps / _rows(total, shape), lse
    return jnp.where(real, 1.0 / (1.0 + jnp.exp(-logits)), 0.0), lse


def _lowest_column(values, target, col, columns: int) -> Array:
    """[TILE] int32: the lowest column where the row's values equal its target (columns where
    none does)."""
    return jnp.where(values == _rows(target, values.shape), col, columns).min(axis=1)


def _in_group(col, g: int, width: int) -> Array:
    """bool: the columns of group g (width experts a group)."""
    return (col >= g * width) & (col < (g + 1) * width)


def _group_scores(biased, col, spec: RouterSpec) -> list[Array]:
    """Each group's score [TILE]: the sum of its two best biased scores."""
    width, columns = spec.experts_per_group, biased.shape[1]
    scores = []
    for g in range(spec.num_groups):
        member = jnp.where(_in_group(col, g, width), biased, -jnp.inf)
        best = member.max(axis=1)
        first = _lowest_column(member, best, col, columns)
        second = jnp.where(col == _rows(first, col.shape), -jnp.inf, member).max(axis=1)
        scores.append(best + second)
    return scores


def _either(a: Array | None, b: Array) -> Array:
    """a | b, with None for "nothing yet" (Mosaic GPU builds no bool constants and no ~ of a
    bool register array in jax 0.11.2)."""
    return b if a is None else a | b


def _flag(pick: Array, flag: Array | None) -> Array:
    """int32 1 where pick, else flag (0 where None)."""
    return jnp.where(pick, 1, 0 if flag is None else flag)


def _eligible(biased, col, spec: RouterSpec) -> Array:
    """bool [TILE, E']: the columns of each row's topk_groups best groups, ties to the lower
    group (invariant 3). A group's flag is int32 1 once chosen."""
    scores = _group_scores(biased, col, spec)
    chosen: list[Array | None] = [None] * len(scores)
    for _ in range(spec.topk_groups):
        left = [
            s if c is None else jnp.where(c == 1, -jnp.inf, s)
            for c, s in zip(chosen, scores, strict=True)
        ]
        best = functools.reduce(jnp.maximum, left)
        taken = None
        for g, value in enumerate(left):
            pick = value == best
            if taken is not None:
                pick = pick & (taken == 0)
            chosen[g] = _flag(pick, chosen[g])
            taken = _flag(pick, taken)
    width = spec.experts_per_group
    eligible = None
    for g, c in enumerate(chosen):
        eligible = _either(eligible, _in_group(col, g, width) & _rows(c == 1, col.shape))
    return eligible


def _select(biased, scores, col, spec: RouterSpec) -> tuple[list, list, Array]:
    """K rounds of selection (invariant 3): ([TILE] int32 experts, [TILE] f32 scores) per slot,
    and the bool [TILE, E'] chosen columns."""
    columns = biased.shape[1]
    chosen = None
    experts, weights = [], []
    for _ in range(spec.top_k):
        index = _lowest_column(biased, biased.max(axis=1), col, columns)
        index = jnp.minimum(index, spec.num_experts - 1)
        hit = col == _rows(index, col.shape)
        weights.append(jnp.where(hit, scores, 0.0).sum(axis=1))
        experts.append(index)
        chosen = _either(chosen, hit)
        biased = jnp.where(hit, -jnp.inf, biased)
    return experts, weights, chosen


def _normalized(weights: list, spec: RouterSpec) -> list:
    """The slots' weights divided by their sum in slot order (0 where it is 0), scaled."""
    if spec.norm_topk_prob:
        total = functools.reduce(lambda a, b: a + b, weights)
        positive = total > 0
        safe = jnp.where(positive, total, 1.0)
        weights = [jnp.where(positive, w / safe, 0.0) for w in weights]
    return [w * spec.routed_scaling for w in weights]


def _tile_sums(scores, chosen, real_rows) -> tuple[Array, Array]:
    """([E'] int32 counts, [E'] f32 shares) over the tile's real tokens (invariant 5)."""
    shape = scores.shape
    shares = scores / _rows(scores.sum(axis=1), shape)
    counts = jnp.where(chosen & real_rows, 1, 0).sum(axis=0)
    return counts, jnp.where(real_rows, shares, 0.0).sum(axis=0)


def _load_columns(ref) -> Array:
    """An [E'] column vector from ref [E'] in GMEM."""

    def scope(smem, barrier):
        plgpu.copy_gmem_to_smem(ref, smem, barrier)
        plgpu.barrier_wait(barrier)
        return plgpu.load(smem, layout=_COLUMN)

    return pl.run_scoped(scope, plgpu.SMEM(ref.shape, ref.dtype), plgpu.Barrier())


def _store(outs, values, u) -> None:
    """Invariant 4: the tile's slots, rows and sums, through shared memory."""
    experts, weights, logits, lse, counts, shares = values
    experts_ref, weights_ref, logits_ref, lse_ref, counts_ref, shares_ref = outs
    top_k, columns = len(experts), logits.shape[1]
    tokens = pl.ds(u * TILE, TILE)

    def scope(experts_smem, weights_smem, logits_smem, lse_smem, counts_smem, shares_smem):
        for j in range(top_k):
            experts_smem[j] = experts[j]
            weights_smem[j] = weights[j]
        logits_smem[...] = logits
        lse_smem[...] = lse
        counts_smem[...] = counts
        shares_smem[...] = shares
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(experts_smem, experts_ref.at[:, tokens])
        plgpu.copy_smem_to_gmem(weights_smem, weights_ref.at[:, tokens])
        plgpu.copy_smem_to_gmem(logits_smem, logits_ref.at[tokens])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[tokens])
        plgpu.copy_smem_to_gmem(counts_smem, counts_ref.at[u])
        plgpu.copy_smem_to_gmem(shares_smem, shares_ref.at[u])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scope,
        plgpu.SMEM((top_k, TILE), jnp.int32),
        plgpu.SMEM((top_k, TILE), jnp.float32),
        plgpu.SMEM((TILE, columns), jnp.float32),
        plgpu.SMEM((TILE,), jnp.float32),
        plgpu.SMEM((columns,), jnp.int32),
        plgpu.SMEM((columns,), jnp.float32),
    )


def _kernel(x_ref, pieces_ref, bias_ref, *outs, spec: RouterSpec, num_tokens: int):
    u = lax.axis_index("tile")
    logits = _logits(x_ref, pieces_ref, u)
    shape = logits.shape
    col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    real = col < spec.num_experts
    scores, lse = _scores(logits, real, spec)
    biased = jnp.where(real, scores + _columns(_load_columns(bias_ref), shape), -jnp.inf)
    if spec.num_groups is not None:
        biased = jnp.where(_eligible(biased, col, spec), biased, -jnp.inf)
    experts, weights, chosen = _select(biased, scores, col, spec)
    counts, shares = _tile_sums(scores, chosen, row < num_tokens - u * TILE)
    _store(outs, (experts, _normalized(weights, spec), logits, lse, counts, shares), u)


def _interpret_params(interpret: bool | plgpu.InterpretGPUParams):
    if interpret is True:
        return plgpu.InterpretGPUParams()
    return interpret or None


def _forward_call(x_td, pieces, bias, spec: RouterSpec, num_tokens: int, interpret):
    """The forward kernel on padded tokens [T', D]: the raw outputs, [K, T'] slots first."""
    padded, columns, k = x_td.shape[0], pieces.shape[2], spec.top_k
    tiles = padded // TILE
    out_type = (
        jax.ShapeDtypeStruct((k, padded), jnp.int32),
        jax.ShapeDtypeStruct((k, padded), jnp.float32),
        jax.ShapeDtypeStruct((padded, columns), jnp.float32),
        jax.ShapeDtypeStruct((padded,), jnp.float32),
        jax.ShapeDtypeStruct((tiles, columns), jnp.int32),
        jax.ShapeDtypeStruct((tiles, columns), jnp.float32),
    )
    call = plgpu.kernel(
        functools.partial(_kernel, spec=spec, num_tokens=num_tokens),
        out_type=out_type,
        grid=(tiles,),
        grid_names=("tile",),
        interpret=_interpret_params(interpret),
    )
    return call(x_td, pieces, bias)


def _padded_tokens(x_td: Array) -> Array:
    num_tokens = x_td.shape[0]
    return jnp.pad(x_td, ((0, pl.cdiv(num_tokens, TILE) * TILE - num_tokens), (0, 0)))


def route(
    x_td: Array,
    router_de: Array,
    bias_e: Array,
    spec: RouterSpec,
    *,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> Routed:
    """The router's forward on T tokens (`reference.route`'s outputs, its tiles of TILE tokens).

    Args:
      x_td: bf16 [T, D], D a multiple of BLOCK_K.
      router_de: [D, E] (f32 or bf16; used at full f32 precision, invariant 1), E <= 256.
      bias_e: [E] the selection bias (any float dtype, used in f32).
      spec: the `RouterSpec`.
      interpret: run in GPU interpret mode (True, or its `InterpretGPUParams`).

    Returns:
      `Routed`: experts int32 [T, K], weights f32 [T, K], logits f32 [T, E], lse f32 [T],
      counts int32 [U, E] and shares f32 [U, E] over the U = ceil(T / TILE) tiles.
    """
    check_inputs(x_td, router_de, bias_e, spec)
    num_tokens, e = x_td.shape[0], spec.num_experts
    columns = padded_experts(e)
    bias = jnp.pad(bias_e.astype(jnp.float32), (0, columns - e))
    raw = _forward_call(
        _padded_tokens(x_td), router_pieces(router_de, columns), bias, spec, num_tokens, interpret
    )
    experts, weights, logits, lse, counts, shares = raw
    routed = Routed(
        experts_tk=experts[:, :num_tokens].T,
        weights_tk=weights[:, :num_tokens].T,
        logits_te=logits[:num_tokens, :e],
        lse_t=lse[:num_tokens],
        counts_ue=counts[:, :e],
        shares_ue=shares[:, :e],
    )
    # Inside shard_map: typed to vary where the tokens do (the kernel's outputs drop it).
    return jax.tree.map(lambda out: like(out, x_td), routed)


# ----------------------------------------------------------------------------------------------
# The backward: x's gradient and the logits' (for the router's), a program per tile.
#
#   B1. The program recomputes its tile's logits with the forward's K steps (invariant 2), so
#       scores and lse are the forward's bits; the chosen columns are the forward's experts.
#   B2. d_logits is a row-wise function of the tile (the cotangents of the weights, the lse and
#       the tile's score shares, the last for its real tokens only); dx = d_logits @ router^T
#       from the three bf16 pieces of each (six wgmmas a block of D, the products whose
#       pieces' ranks add up to at most 2), accumulated in f32: f32 precision, one writer
#       per element, no split-K. So a token's dx is the same bits in any tile and at any T
#       (tests/pallas_kernels/routing/test_ops.py), and both match the reference's gradients
#       (test_contracts.py's router_grads row).

DX_PAIRS = ((0, 0), (0, 1), (1, 0), (0, 2), (1, 1), (2, 0))  # (d_logits piece, router piece)
DX_BLOCK_N = 64  # columns of dx a pipeline step


def _load_slots(ref, u, count: int) -> list[Array]:
    """`count` [TILE] row vectors: columns [u * TILE, (u + 1) * TILE) of ref [count, T']."""

    def scope(smem, barrier):
        plgpu.copy_gmem_to_smem(ref.at[:, pl.ds(u * TILE, TILE)], smem, barrier)
        plgpu.barrier_wait(barrier)
        return [plgpu.load(smem.at[j], layout=_ROW) for j in range(count)]

    return pl.run_scoped(scope, plgpu.SMEM((count, TILE), ref.dtype), plgpu.Barrier())


def _chosen_grad(scores, hits, d_weights, spec: RouterSpec) -> Array:
    """d_scores [TILE, E'] from the weights' cotangents (normalization and scaling undone)."""
    raw = [jnp.where(hit, scores, 0.0).sum(axis=1) for hit in hits]
    if spec.norm_topk_prob:
        total = functools.reduce(lambda a, b: a + b, raw)
        positive = total > 0
        safe = jnp.where(positive, total, 1.0)
        inner = functools.reduce(
            lambda a, b: a + b, [d * r for d, r in zip(d_weights, raw, strict=True)]
        )
        d_raw = [
            jnp.where(positive, (d / safe - inner / (safe * safe)) * spec.routed_scaling, 0.0)
            for d in d_weights
        ]
    else:
        d_raw = [d * spec.routed_scaling for d in d_weights]
    terms = [jnp.where(hit, _rows(d, hit.shape), 0.0) for hit, d in zip(hits, d_raw, strict=True)]
    return functools.reduce(lambda a, b: a + b, terms)


def _logits_grad(logits, real, real_rows, cts, spec: RouterSpec) -> Array:
    """d_logits [TILE, E'] (B2): cts = (experts, d_weights, d_lse, d_shares) of the tile."""
    experts, d_weights, d_lse, d_shares = cts
    shape = logits.shape
    col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    scores, lse = _scores(logits, real, spec)
    hits = [col == _rows(e, shape) for e in experts]
    d_scores = _chosen_grad(scores, hits, d_weights, spec)
    total = _rows(scores.sum(axis=1), shape)
    shares = scores / total
    d_shares = jnp.where(real_rows, _columns(d_shares, shape), 0.0)
    d_scores = d_scores + (d_shares - _rows((d_shares * shares).sum(axis=1), shape)) / total
    if spec.score_fn == "softmax":
        d_logits = scores * (d_scores - _rows((scores * d_scores).sum(axis=1), shape))
    else:
        d_logits = jnp.where(real, d_scores * scores * (1.0 - scores), 0.0)
    softmax = jnp.exp(jnp.where(real, logits, -jnp.inf) - _rows(lse, shape))
    return d_logits + _rows(d_lse, shape) * softmax


def _dx(d_pieces, pieces_t_ref, dx_ref, u) -> None:
    """dx's row tile, block by block of D (B2); d_pieces: d_logits' bf16 pieces in SMEM. Each
    block is stored through dx_smem before the next is formed there (the pipeline's own
    output copies are predicated, which GPU interpret mode does not run)."""
    columns, d = pieces_t_ref.shape[1], pieces_t_ref.shape[2]
    # Shared memory: d_logits' pieces (6 KiB a 16 experts) and a stage of the router's
    # transposed pieces (the same again per 64 columns of D) must fit 227 KiB.
    block_n = DX_BLOCK_N
    stages = STAGES if columns <= 128 else 1
    piece_specs = [
        plgpu.BlockSpec(
            (None, columns, block_n), functools.partial(_piece_block_n, p), transforms=_swizzled()
        )
        for p in range(PIECES)
    ]

    def scope(dx_smem):
        def step(indices, *wt_smems):
            (n,) = indices

            def accumulate(acc_ref):
                for a, b in DX_PAIRS:
                    plgpu.wgmma(acc_ref, d_pieces[a], wt_smems[b])
                plgpu.wgmma_wait(0)
                return acc_ref[...]

            dx_smem[...] = pl.run_scoped(accumulate, plgpu.ACC((TILE, block_n))).astype(
                dx_smem.dtype
            )
            plgpu.commit_smem()
            block = dx_ref.at[pl.ds(u * TILE, TILE), pl.ds(n * block_n, block_n)]
            plgpu.copy_smem_to_gmem(dx_smem, block)
            plgpu.wait_smem_to_gmem(0)

        plgpu.emit_pipeline(
            step, grid=(d // block_n,), in_specs=piece_specs, max_concurrent_steps=stages
        )(*(pieces_t_ref,) * PIECES)

    pl.run_scoped(scope, plgpu.SMEM((TILE, block_n), dx_ref.dtype, transforms=_swizzled()))


def _piece_block_n(piece: int, n):
    return (piece, 0, n)


def _store_tile(value, ref, u) -> None:
    def scope(smem):
        smem[...] = value
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, ref.at[pl.ds(u * TILE, TILE)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scope, plgpu.SMEM(value.shape, value.dtype))


def _backward_kernel(x_ref, pieces_ref, pieces_t_ref, *refs, spec: RouterSpec, num_tokens: int):
    experts_ref, d_weights_ref, d_lse_ref, d_shares_ref, dx_ref, d_logits_ref = refs
    u = lax.axis_index("tile")
    logits = _logits(x_ref, pieces_ref, u)
    shape = logits.shape
    col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
    cts = (
        _load_slots(experts_ref, u, spec.top_k),
        _load_slots(d_weights_ref, u, spec.top_k),
        _load_slots(d_lse_ref, u, 1)[0],
        _load_columns(d_shares_ref.at[u]),
    )
    d_logits = _logits_grad(logits, col < spec.num_experts, row < num_tokens - u * TILE, cts, spec)
    _store_tile(d_logits, d_logits_ref, u)

    def scope(*piece_smems):
        # wgmma reads its left operand from shared memory here (GPU interpret mode runs no
        # register operand).
        for piece_smem, piece in zip(piece_smems, split(d_logits), strict=True):
            piece_smem[...] = piece
        plgpu.commit_smem()
        _dx(piece_smems, pieces_t_ref, dx_ref, u)

    piece = plgpu.SMEM(shape, jnp.bfloat16, transforms=_swizzled())
    pl.run_scoped(scope, *(piece,) * PIECES)


def route_backward(
    x_td: Array,
    router_de: Array,
    experts_tk: Array,
    cotangents: tuple[Array, Array, Array],
    spec: RouterSpec,
    *,
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> tuple[Array, Array]:
    """The router's backward on T tokens: (dx [T, D] in x's dtype, d_logits f32 [T, E]).

    experts_tk: the forward's experts [T, K]. cotangents: of the weights f32 [T, K], the lse f32
    [T] and the tile sums of the score shares f32 [U, E]."""
    d_weights_tk, d_lse_t, d_shares_ue = cotangents
    num_tokens, e = x_td.shape[0], spec.num_experts
    x_pad = _padded_tokens(x_td)
    padded, columns = x_pad.shape[0], padded_experts(e)
    pieces = router_pieces(router_de, columns)
    slots = lambda a: jnp.pad(a.T, ((0, 0), (0, padded - num_tokens)))  # noqa: E731
    call = plgpu.kernel(
        functools.partial(_backward_kernel, spec=spec, num_tokens=num_tokens),
        out_type=(
            jax.ShapeDtypeStruct(x_pad.shape, x_td.dtype),
            jax.ShapeDtypeStruct((padded, columns), jnp.float32),
        ),
        grid=(padded // TILE,),
        grid_names=("tile",),
        interpret=_interpret_params(interpret),
    )
    dx, d_logits = call(
        x_pad,
        pieces,
        jnp.swapaxes(pieces, 1, 2),
        slots(experts_tk),
        slots(d_weights_tk.astype(jnp.float32)),
        slots(d_lse_t.astype(jnp.float32)[:, None]),
        jnp.pad(d_shares_ue.astype(jnp.float32), ((0, 0), (0, columns - e))),
    )
    return like(dx[:num_tokens], x_td), like(d_logits[:num_tokens, :e], x_td)
