"""The expert-parallel exchange inside a kernel: protocol.py (the tables: who writes which slot,
which semaphore counts what, from the all-gathered counts), moves.py (`Moves`, one device's
copy tables), reference.py (the spec, with JAX's collectives), mosaic_gpu.py (one direction of
a round as one Mosaic GPU kernel of remote copies and semaphores; and the copies overlapped with
GEMMs in one kernel: `dispatch_swiglu` and `down_return` in the forward, `dispatch_down_grad`
and `dgrad_return` in the backward), ops.py (`send_rows` and `dispatch_mlp`, the
differentiable ops) and tuning.py (the tuned exchange programs, a device kind each).

The kernels' modules (mosaic_gpu, ops, reference, tuning and the names from ops) are re-exported
on first use, so that importing the protocol does not load Mosaic GPU."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pallas_kernels.exchange import protocol
from pallas_kernels.exchange.moves import Moves

if TYPE_CHECKING:
    from pallas_kernels.exchange import mosaic_gpu, ops, reference, tuning
    from pallas_kernels.exchange.ops import EXCHANGE_FUSIONS, ExchangeFusion

_MODULES = ("mosaic_gpu", "ops", "reference", "tuning")
_FROM_OPS = ("EXCHANGE_FUSIONS", "ExchangeFusion")


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _FROM_OPS:
        return getattr(importlib.import_module(f"{__name__}.ops"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EXCHANGE_FUSIONS",
    "ExchangeFusion",
    "Moves",
    "mosaic_gpu",
    "ops",
    "protocol",
    "reference",
    "tuning",
]
