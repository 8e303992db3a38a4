"""uform: one multimodal transformer tower, trained with masked, contrastive, late-interaction and
calibrated-choice objectives, on one GPU or many, and served from the checkpoint it wrote.

The names follow the Rust API page of UForm 4's trainer; docs/design.md says how, with the conventions the code
pins, and docs/architecture.md draws the layers.
"""

import importlib
from typing import TYPE_CHECKING, Any

# Names resolve lazily (PEP 562), so that a media decoding worker process, which imports
# `uform.media`, does not pay for importing torch.
_WHERE = {
    "Arena": "arena",
    "CheckpointError": "replica.checkpoint",
    "Stopped": "replica.checkpoint",
    "AudioShape": "config",
    "BatchShape": "config",
    "Choices": "config",
    "Contrastive": "config",
    "ImageShape": "config",
    "LateInteraction": "config",
    "Masking": "config",
    "Schedule": "config",
    "TrainerInitVramConfig": "config",
    "TrainerSaveConfig": "config",
    "TrainerStepConfig": "config",
    "TrainerStepStats": "config",
    "VideoShape": "config",
    "resolve": "config",
    "GPUClass": "enums",
    "LateInteractionSide": "enums",
    "Modality": "enums",
    "MultimemTier": "enums",
    "Negatives": "enums",
    "Objective": "enums",
    "PairLossForm": "enums",
    "Scalar": "enums",
    "evaluate_retrieval": "evaluate",
    "fit": "fitting",
    "export": "exporting",
    "encode_file": "encoding",
    "Executor": "runtime.executor",
    "Mesh": "runtime.mesh",
    "MeshDescription": "runtime.mesh",
    "MeshError": "runtime.mesh",
    "MeshOptions": "runtime.mesh",
    "Edges": "relations",
    "Relations": "relations",
    "Model": "serve",
    "load": "serve",
    "Trainer": "trainer",
    "UformWarning": "notices",
    "MediaWarning": "notices",
    "MemoryWarning": "notices",
    "NonFiniteWarning": "notices",
    "CapacityWarning": "notices",
    "ScheduleWarning": "notices",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:  # the package's one lazy import (PEP 562; why: above `_WHERE`)
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'uform' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


if TYPE_CHECKING:
    from .arena import Arena
    from .config import (
        AudioShape,
        BatchShape,
        Choices,
        Contrastive,
        ImageShape,
        LateInteraction,
        Masking,
        Schedule,
        TrainerInitVramConfig,
        TrainerSaveConfig,
        TrainerStepConfig,
        TrainerStepStats,
        VideoShape,
        resolve,
    )
    from .encoding import encode_file
    from .enums import GPUClass, LateInteractionSide, Modality, MultimemTier, Negatives, Objective, PairLossForm, Scalar
    from .evaluate import evaluate_retrieval
    from .exporting import export
    from .fitting import fit
    from .notices import CapacityWarning, MediaWarning, MemoryWarning, NonFiniteWarning, ScheduleWarning, UformWarning
    from .relations import Edges, Relations
    from .replica.checkpoint import CheckpointError, Stopped
    from .runtime.executor import Executor
    from .runtime.mesh import Mesh, MeshDescription, MeshError, MeshOptions
    from .serve import Model, load
    from .trainer import Trainer

__version__ = "4.0.0rc1"

__all__ = [
    "Arena",
    "AudioShape",
    "BatchShape",
    "CapacityWarning",
    "CheckpointError",
    "Choices",
    "Contrastive",
    "Edges",
    "Executor",
    "GPUClass",
    "ImageShape",
    "LateInteraction",
    "LateInteractionSide",
    "Masking",
    "MediaWarning",
    "MemoryWarning",
    "Mesh",
    "MeshDescription",
    "MeshError",
    "MeshOptions",
    "Modality",
    "Model",
    "MultimemTier",
    "Negatives",
    "NonFiniteWarning",
    "Objective",
    "PairLossForm",
    "Relations",
    "Scalar",
    "Schedule",
    "ScheduleWarning",
    "Stopped",
    "Trainer",
    "TrainerInitVramConfig",
    "TrainerSaveConfig",
    "TrainerStepConfig",
    "TrainerStepStats",
    "UformWarning",
    "VideoShape",
    "encode_file",
    "evaluate_retrieval",
    "export",
    "fit",
    "load",
    "resolve",
]
