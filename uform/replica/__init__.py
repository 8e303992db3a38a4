"""One device's replica: its step pipeline, the optimizer, the memory estimate, the capacity notices and the checkpoint files."""
