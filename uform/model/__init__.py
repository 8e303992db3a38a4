"""The tower and its heads."""
