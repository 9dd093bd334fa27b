"""The router: scores, top-k selection and routing weights of tiles of tokens. reference.py
(the spec, which the layer's routing calls), mosaic_gpu.py (the forward and backward kernels),
ops.py (the custom_vjp, and the router weights' gradient)."""
