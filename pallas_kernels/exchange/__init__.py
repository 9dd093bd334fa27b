"""The expert-parallel exchange inside a kernel (issue 7): moves.py (`Moves`, one device's copy
tables), reference.py (the spec, with JAX's collectives), mosaic_gpu.py (one direction of a
round as one Mosaic GPU kernel of remote copies and semaphores; and the copies overlapped with
GEMMs in one kernel: `dispatch_swiglu` and `down_return` in the forward, `dispatch_down_grad`
and `dgrad_return` in the backward), ops.py (`send_rows` and `dispatch_mlp`, the
differentiable ops) and tuning.py (the tuned exchange programs, a device kind each). The
protocol that builds the tables (slots, copies, counts) is mok_jax/exchange_protocol.py's."""

from pallas_kernels.exchange import mosaic_gpu, ops, reference, tuning
from pallas_kernels.exchange.moves import Moves
from pallas_kernels.exchange.ops import EXCHANGE_FUSIONS, ExchangeFusion

__all__ = [
    "EXCHANGE_FUSIONS",
    "ExchangeFusion",
    "Moves",
    "mosaic_gpu",
    "ops",
    "reference",
    "tuning",
]
