"""`OnnxEncoder`: an exported folder's `model.onnx` run by onnxruntime, with the host work in Python.

The split (`onnx_export` draws the graph): onnxruntime runs the network's forward over one packed batch; this
module does what `Model.encode` does on the host around it, with the same functions: media decoded into patch
units in the decode workers (`media.decode.decode_items`), windows of items sorted longest first, cut into
batches by first fit and packed by the trainer's own packing (`data.windows.call_batches` and `pack_batch`, as a
`Model` on the CPU packs them), and each answer cut to the chosen Matryoshka width and L2-normalised. So its
vectors are `Model.encode`'s, up to the float reassociation of another runtime's kernels (tests/test_onnx.py holds
them within 1e-4 of cosine on the CPU).

The folder is checked first, as `uform.load` checks it (`replica.stored_model.read_model`: digest, config), and
`model.onnx` against the SHA-256 that `model.safetensors` vouches for, so a swapped graph is refused too.
Needs the `onnx` extra (onnxruntime). A media item that cannot be decoded raises `MediaError` naming it.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import threading
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from . import vocab
from .data.items import parse_contents, parse_modalities
from .data.windows import CallItems, Packed, Packing, call_batches, pack_batch
from .enums import LateInteractionSide, Modality, Objective
from .media.decode import MediaPolicy, decode_items
from .media.limits import MediaError
from .notices import Notices
from .replica.capacity import warn_truncated
from .replica.checkpoint import CheckpointError
from .replica.stored_model import ONNX_FILE, file_digest, read_model
from .runtime.decoders import DecodePool
from .serve_args import check_width

__all__ = ["OnnxEncoder"]


class OnnxEncoder:
    """The encode verb of an exported folder's `model.onnx` (see the module docstring); `close` stops its
    decoders. `threads` bounds onnxruntime's intra-op threads (zero: its default)."""

    def __init__(self, folder: str | os.PathLike, *, threads: int = 0, media: MediaPolicy | None = None) -> None:
        import onnxruntime

        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise ValueError(f"threads: expected a non-negative int, got {threads!r}")
        served, files = read_model(folder)
        path = os.path.join(os.fspath(folder), ONNX_FILE)
        if ONNX_FILE not in files:
            raise CheckpointError(f"{os.fspath(folder)}: exported without --onnx; it holds no {ONNX_FILE}")
        if not hmac.compare_digest(file_digest(path, path), files[ONNX_FILE]):
            raise CheckpointError(f"{path}: changed since the export (its SHA-256 is not the one vouched for)")
        self.config = served.config
        """The run's resolved config."""
        del served
        options = onnxruntime.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        self.session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self._names = [i.name for i in self.session.get_inputs()]
        b = self.config.batch
        self.rows, self.columns, self.segments = b.max_rows_per_device, b.max_columns_per_row, b.max_segments_per_device
        self.media = MediaPolicy() if media is None else media
        self._late = self.config.late_interaction.weight > 0
        self._prefix = len(vocab.prefix(Modality.Text, LateInteractionSide.None_ if self._late else None))
        self._serving = dataclasses.replace(
            self.config, objective=Objective.Contrastive, batch=dataclasses.replace(b, max_bags_per_device=0)
        )
        self._decoders: DecodePool | None = None
        self.notices = Notices()
        """Its warnings, each kind shown once and counted: "capacity.truncated" (items cut to a row), as a
        `Model`'s."""

    @property
    def hidden(self) -> int:
        """The pooled embeddings' full width."""
        return self.config.hidden

    def close(self) -> None:
        """Stops the media decoders (started on the first media item)."""
        if self._decoders is not None:
            self._decoders.close()
            self._decoders = None

    def __enter__(self) -> OnnxEncoder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def encode(self, modalities: Any, contents: Any, width: int | None = None) -> torch.Tensor:
        """The L2-normalised pooled embeddings [N, width] f32 of the items (`Model.encode`'s arguments and
        answer, f32 only; a media item that cannot be decoded raises `MediaError` naming it)."""
        mods = parse_modalities(modalities)
        items = parse_contents(contents, len(mods))
        width = self.hidden if width is None else check_width(width, self.hidden)
        n = len(mods)
        out = torch.zeros(n, width)
        cut = 0
        shape = Packing(
            config=self._serving,
            columns=self.columns,
            prefix=self._prefix,
            segments=self.segments,
            packing=(self.rows, self.columns),
            fixed=False,  # only the rows a batch uses, as an eager `Model` packs
            flex=False,
            window=2 * self.segments,
        )
        call = CallItems("encode", mods, items, None)

        def decode(window: range) -> tuple[dict[int, Any], list[tuple[int, str]], dict[int, Any]]:
            return self._decode(mods, items, window), [], {}  # a media item that fails raises in `_decode`

        def pack(members: list[int], rows: int, units: dict[int, Any], _along: dict[int, Any]) -> Packed:
            return pack_batch(shape, call, members, rows, units, np.empty)

        for _kind, packed in call_batches(shape, call, decode, pack, threading.Event()):  # batches only
            pooled = self._forward(packed)  # [n, D]
            out[torch.from_numpy(packed.members)] = F.normalize(pooled[:, :width], dim=-1)
            cut += packed.truncated
        advice = f"the graph serves at its run's batch.max_columns_per_row ({self.columns} positions a row)"
        warn_truncated(self.notices, cut, n, "encode", advice, 2)
        return out

    def _decode(self, mods: list[Modality], items: list[Any], chunk: range) -> dict[int, Any]:
        media = [i for i in chunk if mods[i] != Modality.Text]
        if not media:
            return {}
        if self._decoders is None:
            self._decoders = DecodePool(self.media.workers, self.media.limits.timeout_seconds)
        units, failed = decode_items(  # unkeyed: encoding draws no masks
            self._decoders, self.media, self.config.batch, mods, items, media, self.columns - self._prefix, False
        )
        if failed:
            item, reason = min(failed)
            raise MediaError(reason, item=item)
        return units

    def _forward(self, packed: Packed) -> torch.Tensor:
        """One packed batch through the graph: its members' pooled embeddings [n, D]."""
        host = packed.batch.host_tensors(False)
        feed = {name: host[name].numpy() for name in self._names}
        pooled = torch.from_numpy(self.session.run(["pooled"], feed)[0])  # [S, D]
        return pooled[torch.from_numpy(packed.picks)]  # [n, D]: each member's segment slot
