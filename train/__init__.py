"""The MoE language model, its jitted training loop and `python -m train` (the training issue).
Imports mok_jax; nothing imports train."""
