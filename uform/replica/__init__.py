"""One device's replica: the optimizer, the memory estimate, the capacity notices and the checkpoint files."""
