"""What a loss needs to know of the world it is computed in: `Peers`.

Shape legend: S segment slots of one process's step, W processes.

The losses and the network's heads are told the world as an argument (open_clip passes rank and world
size to its loss, never to its model); they see it only through this protocol, which the runtime's
`uform.runtime.world.World` satisfies, so the pure layers import nothing of the runtime.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor


class Peers(Protocol):
    """This process's place in a world of processes, and the collectives a step's losses use."""

    @property
    def rank(self) -> int:
        """This process's index, 0 to size - 1."""
        ...

    @property
    def size(self) -> int:
        """Processes in the world."""
        ...

    def all_reduce(self, tensor: Tensor) -> Tensor:
        """Sums `tensor` over the world, in place; answers it."""
        ...

    def gather(self, x: Tensor) -> Tensor:
        """x [S, ...] -> [W * S, ...] (rank-major), without gradient."""
        ...

    def gather_with_grad(self, x: Tensor) -> Tensor:
        """x [S, ...] -> [W * S, ...] (rank-major), differentiable: each process's gradient for its own rows
        sums every process's gradient of them."""
        ...
