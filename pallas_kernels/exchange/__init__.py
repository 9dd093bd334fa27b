"""The expert-parallel exchange inside a kernel (issue 7): moves.py (`Moves`, one device's copy
tables), reference.py (the spec, with JAX's collectives), mosaic_gpu.py (one direction of a
round as one Mosaic GPU kernel of remote copies and semaphores) and ops.py (`send_rows`, the
differentiable op). The protocol that builds the tables (slots, copies, counts) is
mok_jax/exchange_protocol.py's."""

from pallas_kernels.exchange import mosaic_gpu, ops, reference
from pallas_kernels.exchange.moves import Moves

__all__ = ["Moves", "mosaic_gpu", "ops", "reference"]
