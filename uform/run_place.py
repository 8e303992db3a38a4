"""One process's place among the processes of a training run: alone, or one of a mesh's (torchrun's ranks, or
the hosts of `Mesh.bootstrap`, each driving one device or several).

    place = RunPlace(mesh)                  # RunPlace(None): the only process
    loader = Loader(source, config, **place.loader_shares(devices))
    checkpoint = place.agree(lambda: folder.latest())   # the lead decides, every process gets its answer
    state = place.data_state(loader.state())            # every process's shares, merged

The lead (the process of rank 0, which writes checkpoints) also writes the run's folder, its metrics and its
console lines; every other process trains, saves (its replica takes part, rank 0 writes) and writes nothing.
What the processes tell each other goes through `Mesh.exchange` between two steps: small JSON texts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from .runtime.mesh import Mesh
from .sources import merge_states

__all__ = ["RunPlace"]

T = TypeVar("T")

_REFUSALS: dict[str, type[Exception]] = {
    kind.__name__: kind for kind in (ValueError, TypeError, FileExistsError, FileNotFoundError, OSError)
}
"""The refusals a lead's check may raise that the other processes raise alike (others: `RuntimeError`)."""


class RunPlace:
    """This process among a run's processes; see the module's docstring."""

    def __init__(self, mesh: Mesh | None) -> None:
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(f"mesh: expected None or a Mesh, got {type(mesh).__name__}")
        self.mesh = mesh
        """The run's mesh (None: this process alone)."""
        if mesh is None:
            self.process, self.processes, self.devices = 0, 1, 0
        else:
            description = mesh.describe()
            per_process = len(description.ranks)
            self.process = description.ranks[0] // per_process
            self.processes = description.world_size // per_process
            self.devices = description.world_size
        self.lead = self.process == 0
        """Whether this process writes the run's folder (rank 0's, which also writes the checkpoints)."""

    def __repr__(self) -> str:
        return f"RunPlace(process={self.process}, processes={self.processes}, lead={self.lead})"

    def loader_shares(self, local_devices: int) -> dict[str, int]:
        """`Loader`'s `rank`, `world` and `devices` for this process: its own shares of each global step, one a
        device of the whole world (`local_devices` are this process's own, which alone counts without a mesh)."""
        if self.mesh is None:
            return {"rank": 0, "world": 1, "devices": local_devices}
        return {"rank": self.process, "world": self.processes, "devices": self.devices}

    def agree(self, decide: Callable[[], T]) -> T:
        """The lead's `decide()` (a JSON-able answer), on every process; where the lead's call raised, every
        process raises its refusal (a `ValueError`, `OSError`, ... of the same message; others as
        `RuntimeError`), so no process goes on alone into a world the others left."""
        if self.mesh is None:
            return decide()
        verdict: dict[str, Any] = {}
        if self.lead:
            try:
                verdict = {"value": decide()}
            except Exception as error:
                self._exchange({"error": type(error).__name__, "message": str(error)})
                raise
        answer = self._exchange(verdict)[0]
        if "error" in answer:
            raise _REFUSALS.get(answer["error"], RuntimeError)(answer["message"])
        return answer["value"]

    def data_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The run's data position from this process's `Loader.state()`: every process's shares merged
        (`merge_states`), so a resume over any number of processes of the same devices continues from it."""
        if self.mesh is None:
            return state
        return merge_states(self._exchange(state))

    def _exchange(self, value: Any) -> list[Any]:
        assert self.mesh is not None
        return [json.loads(blob) for blob in self.mesh.exchange(json.dumps(value).encode())]
