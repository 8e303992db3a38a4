"""The training losses, as pure functions over tensors."""
