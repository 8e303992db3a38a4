"""uform: one multimodal transformer tower, trained with masked, contrastive, late-interaction and
calibrated-choice objectives, on one GPU or many, and served from the checkpoint it wrote.

The names follow the Rust API page of UForm 4's trainer (see docs/); `DESIGN.md` fixes the Python shape.
"""

from .arena import Arena
from .checkpoint import CheckpointError, Stopped
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
from .enums import LateInteractionSide, Modality, Negatives, Objective, PairLossForm, Scalar
from .executor import Executor
from .relations import Edges, Relations
from .trainer import Trainer

__version__ = "4.0.0rc1"

__all__ = [
    "Arena",
    "AudioShape",
    "BatchShape",
    "CheckpointError",
    "Choices",
    "Contrastive",
    "Edges",
    "Executor",
    "ImageShape",
    "LateInteraction",
    "LateInteractionSide",
    "Masking",
    "Modality",
    "Negatives",
    "Objective",
    "PairLossForm",
    "Relations",
    "Scalar",
    "Schedule",
    "Stopped",
    "Trainer",
    "TrainerInitVramConfig",
    "TrainerSaveConfig",
    "TrainerStepConfig",
    "TrainerStepStats",
    "VideoShape",
    "resolve",
]
