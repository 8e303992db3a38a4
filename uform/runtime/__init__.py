"""The runtime: worker processes, devices, the world of ranks, the prepare and decode processes."""
