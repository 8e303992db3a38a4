"""The enumerations of UForm 4's trainer API, with its member names and integer values (docs/design.md §1).

`Modality`, `Objective` and `Negatives` parse from and print as lower-case words, as the reference
API's `FromStr` / `Display` do; `PairLossForm`, `LateInteractionSide` and `Scalar` parse too, for the CLI.
"""

from __future__ import annotations

import enum
import numbers
from typing import Self


class _Worded(enum.IntEnum):
    """An integer enum that prints as its lower-case name and parses from it."""

    def __str__(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, word: object, field: str | None = None) -> Self:
        """Answers the member named by `word` (any case), or by a member / its integer value (a Python or
        numpy integer)."""
        field = field or cls.__name__
        if isinstance(word, cls):
            return word
        if isinstance(word, bool):
            raise TypeError(f"{field}: expected a {cls.__name__} or its word, got a bool")
        if isinstance(word, enum.Enum):
            # Another enum's member is an int too: refuse it rather than reinterpret its value.
            raise TypeError(f"{field}: expected a {cls.__name__} or its word, got a {type(word).__name__}")
        if isinstance(word, numbers.Integral):  # a numpy integer too (a side read from an array, say)
            try:
                return cls(int(word))
            except ValueError:
                raise ValueError(f"{field}: {word} is not a {cls.__name__} value; one of {cls.words()}") from None
        if isinstance(word, str):
            for member in cls:
                if member.name.lower() == word.strip().lower():
                    return member
            raise ValueError(f"{field}: unknown word {word!r}; expected one of {cls.words()}")
        raise TypeError(f"{field}: expected a {cls.__name__} or its word, got {type(word).__name__}")

    @classmethod
    def words(cls) -> list[str]:
        return [m.name.lower() for m in cls]


class Modality(_Worded):
    """What the bytes of one training item hold."""

    Text = 0
    """UTF-8 text, a byte per token."""
    Image = 1
    """A JPEG, PNG or WebP file."""
    Video = 2
    """An MP4 or WebM file."""
    Audio = 3
    """A WAV, FLAC, MP3 or Opus file."""


class Objective(_Worded):
    """Which losses a step relaxes, one enumerator per combination the engine trains."""

    Masked = 0
    """Masked reconstruction alone, as the Base pretrains."""
    Contrastive = 1
    """The pairwise contrastive loss alone, as the Embedder trains."""
    Joint = 2
    """Both, joined at the final-norm states."""


class Negatives(_Worded):
    """Which pairs the contrastive loss pushes apart."""

    Ambient = 0
    """Repel edges, and every pair no edge names, at the ambient repulsion weight."""
    Named = 1
    """Repel edges alone."""


class PairLossForm(_Worded):
    """How a contrastive term turns a row of scores into forces."""

    Derived = 0
    """The term's own form: sigmoid for pooled vertices, ranked for token vectors."""
    Balanced = 1
    """The sigmoid cross-entropy of every cell, its attract and repel halves normalized apart."""
    Ranked = 2
    """The sigmoid cross-entropy of every positive's score over every negative's, where the bias cancels."""
    Sigmoid = 3
    """SigLIP's sigmoid cross-entropy of every cell, each repel weighed like an attract."""


class LateInteractionSide(_Worded):
    """Which side of a late-interaction score an item takes."""

    # The reference API's first member is `None`, a keyword in Python: it is spelled `None_` here and parses
    # from the word "none".
    None_ = 0
    """The item takes no part in late interaction."""
    Query = 1
    """The item's tokens score the documents it attracts and repels."""
    Document = 2
    """The item's tokens are scored by the queries naming it."""
    QueryAndDocument = 3
    """The item plays both sides."""

    def __str__(self) -> str:
        return "none" if self is LateInteractionSide.None_ else self.name.lower()

    @classmethod
    def words(cls) -> list[str]:
        return [str(m) for m in cls]

    @classmethod
    def parse(cls, word: object, field: str | None = None) -> Self:
        if isinstance(word, str) and word.strip().lower() == "none":
            return cls.None_
        return super().parse(word, field)


class Scalar(_Worded):
    """The scalar type embeddings land as in an `Arena`."""

    F32 = 0
    """IEEE single precision."""
    F16 = 1
    """IEEE half precision."""
    BF16 = 2
    """bfloat16."""
    I8 = 3
    """Signed bytes: each L2-normalised value times 127, rounded (UForm's search-engine format)."""


class MultimemTier(_Worded):
    """How far NVLink multicast (NVLS, the switch-side `multimem` reductions of Hopper and later) reaches in
    a run's collectives. It stays `Off` unless the user turns it on (`MeshOptions.multimem`, or
    `NCCL_NVLS_ENABLE=1` in the environment); the library sets `NCCL_NVLS_ENABLE=0` otherwise."""

    Off = 0
    """No multicast: the collectives use NVLink and the network point to point."""
    Host = 1
    """Multicast among one host's GPUs, through its NVSwitch."""
    Domain = 2
    """Multicast across every host of one multi-node NVLink domain (as on NVL72 racks)."""


class GPUClass(_Worded):
    """The kernel family a device dispatches as, from its compute capability; a run dispatches as the
    lowest class of any of its devices, so that every process compiles the same kernels."""

    CPU = 0
    """No GPU: the development path (dense reference attention, fp32)."""
    Legacy = 1
    """Compute capability below 7.0 (Pascal and older): no tensor cores."""
    Volta = 2
    """7.0 and 7.2: fp16 tensor cores."""
    Turing = 3
    """7.5."""
    Ampere = 4
    """8.0 to 8.7: bf16 tensor cores, asynchronous copies."""
    Ada = 5
    """8.9: fp8 tensor cores."""
    Hopper = 6
    """9.x: TMA, warp-group MMA, thread-block clusters, NVLink multicast."""
    Blackwell = 7
    """10.x and 11.x: tensor memory and fifth-generation tensor cores."""

    @classmethod
    def from_capability(cls, major: int, minor: int) -> GPUClass:
        """The class of a CUDA device of compute capability `major.minor`."""
        if major == 12:  # consumer Blackwell lacks 10.x's tensor memory and Hopper's warp-group MMA
            return cls.Ada
        if major >= 10:
            return cls.Blackwell
        if major == 9:
            return cls.Hopper
        if major == 8:
            return cls.Ada if minor >= 9 else cls.Ampere
        if major == 7:
            return cls.Turing if minor >= 5 else cls.Volta
        return cls.Legacy
