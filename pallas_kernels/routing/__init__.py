"""The router: scores, top-k selection and routing weights of a tile of tokens. reference.py
(the spec, which the layer's routing calls), mosaic_gpu.py (the forward kernel)."""
