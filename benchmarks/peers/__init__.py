"""jddp side by side with hand-written JAX and PyTorch DDP on the same models (``python -m benchmarks.peers``)."""
