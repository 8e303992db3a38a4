"""The encode forward as an ONNX graph (`uform export --onnx`): packed rows in, pooled embeddings out.

The split between the graph and Python. The graph is the network's dense-attention path over one packed batch,
as `Model.encode` runs it on the CPU: token embeddings, each media unit's embedding added at its position, the
rotary code of the axial positions, document-masked attention (a position sees only its own segment), the final
norm, mean pooling per segment and the pooled projection. What stays in Python (`onnx_encoder.OnnxEncoder`) is
what `Model.encode` does on the host anyway: decoding media and cutting them into patch units (`media.decode`),
packing items into rows (`data.batch.prepare`), and cutting the answer to a Matryoshka width and re-normalising it.

Inputs (R rows, C columns, S segments, U units of a medium, F values per unit; every size dynamic):

    tokens [R, C] int64, positions [R, C, 3] int64, segments [R, C] int64 (padding = S), counts [S] int64
    <kind>.values [U, F] (uint8 pixels; float32 audio samples), <kind>.index [U] int64 (flat row * C + column),
    <kind>.valid [U] float32 (0 for inert padding units)   for each medium the run trained

Output: `pooled` [S, D] float32, not normalised (the caller normalises its chosen prefix, as `encode` does).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings

import torch
from torch import Tensor, nn

from .model.attention import document_mask
from .model.inputs import DeviceBatch, MediaUnits
from .model.network import Network

__all__ = ["OPSET", "EncodeGraph", "graph_inputs", "write_onnx"]

OPSET = 18
"""The ONNX opset written (ScatterND's add reduction needs 16; LayerNormalization-era ops 17+)."""


def graph_inputs(network: Network) -> list[str]:
    """The graph's input names, in order."""
    names = ["tokens", "positions", "segments", "counts"]
    for kind in network.media:
        names += [f"{kind}.values", f"{kind}.index", f"{kind}.valid"]
    return names


class EncodeGraph(nn.Module):
    """`network`'s pooled forward over one packed batch, in f32 with dense attention (see the module docstring)."""

    def __init__(self, network: Network) -> None:
        super().__init__()
        self.network = network
        self.kinds = list(network.media)

    def forward(self, tokens: Tensor, positions: Tensor, segments: Tensor, counts: Tensor, *media: Tensor) -> Tensor:
        cos, sin = self.network.rotary(positions, torch.float32)  # [R, C, 1, K/2] each
        parts = {}
        for k, kind in enumerate(self.kinds):
            values, index, valid = media[3 * k : 3 * k + 3]
            parts[kind] = MediaUnits(values, index, torch.zeros_like(index, dtype=torch.bool), valid)
        empty = torch.zeros(0, dtype=torch.int64)
        batch = DeviceBatch(
            tokens=tokens,
            positions=positions,
            segments=segments,
            counts=counts,
            target_index=empty,
            targets=empty,
            target_weight=empty.float(),
            slot_valid=empty.bool(),
            slot_group=empty,
            z=empty.float(),
            w=empty.float(),
            mask=document_mask(segments, "dense"),
            cos=cos,
            sin=sin,
            media=parts,
        )
        states = self.network.states(batch)  # [R, C, D]
        return self.network.pooled(states, segments, counts).float()  # [S, D]


def example_inputs(network: Network) -> tuple[Tensor, ...]:
    """A small batch of two rows and three segments (one medium unit each where the run has media), to trace."""
    rows, columns = 2, 8
    segments = torch.tensor([[0, 0, 0, 1, 1, 3, 3, 3], [2, 2, 2, 2, 3, 3, 3, 3]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0], [0, 1, 2, 3, 0, 0, 0, 0]])[..., None].expand(-1, -1, 3)
    inputs: list[Tensor] = [
        torch.randint(0, 256, (rows, columns)),
        positions.contiguous(),
        segments,
        torch.tensor([3, 2, 4]),
    ]
    for kind, media in network.media.items():
        embedding = media.embedding
        features = (
            embedding.in_features if isinstance(embedding, nn.Linear) else network.config.batch.audio.chunk_samples
        )
        dtype = torch.float32 if kind == "audio" else torch.uint8
        values = torch.randint(0, 255, (2, features)).to(dtype)
        inputs += [values, torch.tensor([1, 9]), torch.ones(2)]
    return tuple(inputs)


def write_onnx(network: Network, path: str | os.PathLike) -> None:
    """Writes `network`'s encode graph (see the module docstring) to `path`, every size dynamic. Needs the `onnx`
    extra (`pip install "uform[onnx]"`: onnx and onnxscript, which `torch.onnx.export` uses)."""
    names = graph_inputs(network)
    dim = torch.export.Dim
    rows, columns, segments = dim("rows"), dim("columns"), dim("segments")
    shapes: list[object] = [{0: rows, 1: columns}, {0: rows, 1: columns}, {0: rows, 1: columns}, {0: segments}]
    media: list[object] = []
    for kind in network.media:
        units = dim(f"{kind}_units")
        media += [{0: units}, {0: units}, {0: units}]
    shapes.append(tuple(media))
    graph = EncodeGraph(network).eval()
    # The exporter warns about axis names it merges and narrates its steps; neither says anything to a user.
    quiet = logging.getLogger("torch.onnx._internal.exporter._registration")  # "torchvision is not installed"
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        _export(graph, network, path, names, shapes)
    finally:
        quiet.setLevel(level)


def _export(graph: EncodeGraph, network: Network, path: str | os.PathLike, names: list[str], shapes: list) -> None:
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(
            graph,
            example_inputs(network),
            os.fspath(path),
            input_names=names,
            output_names=["pooled"],
            dynamic_shapes=shapes,
            opset_version=OPSET,
            dynamo=True,
            external_data=False,  # one file, so the digest's SHA-256 of model.onnx covers every weight in it
            verbose=False,
            optimize=False,  # onnxruntime optimises the graph as it loads it; the exporter's pass doubles the export
        )
