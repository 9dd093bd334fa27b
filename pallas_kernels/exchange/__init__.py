"""The expert-parallel exchange inside a kernel (issue 7): reference.py (the spec, with JAX's
collectives) and mosaic_gpu.py (the dispatch as one Mosaic GPU kernel of remote copies and
semaphores). The protocol the kernels carry out (slots, pieces, counts) is
mok_jax/exchange_protocol.py's."""

from pallas_kernels.exchange import mosaic_gpu, reference

__all__ = ["mosaic_gpu", "reference"]
