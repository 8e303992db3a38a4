"""The whole network of a run: embeddings, tower, heads per modality and objective, and its losses.

Shape legend: R rows, C columns, S segment slots, D hidden, P covered positions, G temperature groups;
Qt query token rows, Dt document token rows, Dd document columns, W token width, K legal bytes per choice.

`Network.losses` is the function one device's step differentiates: from one forward of the (corrupted)
rows (a `model.inputs.DeviceBatch`) it reads both the masked text head and the pooled embeddings off the
same final-norm states, which is what `Objective.Joint` means. It answers every term as a `losses.term.Term`
(sum, count), so the caller (or, on several devices, the world: `losses.term.world_counts`) divides once by
global counts. The world is an argument (`losses.peers.Peers`, or None), never the network's own.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import TrainerInitVramConfig
from ..data.batch import media_features
from ..enums import Negatives, Objective, PairLossForm
from ..losses.choices import choices_sum
from ..losses.contrastive import contrastive_term, world_pairs
from ..losses.late import late_interaction_term
from ..losses.masked import masked_text_sum, masked_units_sum
from ..losses.peers import Peers
from ..losses.term import Term, check_term
from .embed import TokenEmbedding
from .heads import MaskedTextHead, PooledHead, Temperatures, TokenHead
from .inputs import DeviceBatch
from .media import MediaInput
from .tower import Tower


class Losses(NamedTuple):
    """What `Network.losses` answers: every term of the objective by name, and the scored embeddings."""

    terms: dict[str, Term]
    """"masked_text", "masked_<kind>" per live media modality, "contrastive", and where on
    "late_interaction", "choices"."""
    embeddings: Tensor
    """[S, D] the pooled embeddings, L2-normalised and detached (the arena's)."""


class Network(nn.Module):
    def __init__(self, config: TrainerInitVramConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden
        self.embed = TokenEmbedding(hidden)
        self.tower = Tower(config.depth, hidden)
        self.pooled = PooledHead(hidden)
        self.text_head = MaskedTextHead(hidden)
        c = config.contrastive
        self.temperatures = Temperatures(c.temperature_groups, c.inverse_temperature, c.bias)
        features = media_features(config)
        chunk = config.batch.audio.chunk_samples
        self.media = nn.ModuleDict({kind: MediaInput(kind, f, hidden, chunk) for kind, f in features.items()})
        self.reconstruct = nn.ModuleDict({kind: nn.Linear(hidden, f) for kind, f in features.items()})
        # Registered last, so a run without late interaction draws the same initial weights as before.
        li = config.late_interaction
        self.token_head: TokenHead | None = None
        self.late_temperatures: Temperatures | None = None
        if li.weight > 0:
            self.token_head = TokenHead(hidden, li.width)
            self.late_temperatures = Temperatures(c.temperature_groups, li.inverse_temperature, li.bias)

    @torch.no_grad()
    def initialize(self, seed: int) -> None:
        """Keyed initialisation: the same seed gives the same weights on any device.

        Matrices and convolution kernels N(0, 0.02) (BERT), the projections writing into the residual
        stream scaled by 1 / sqrt(2 depth) (GPT-2), the pooled projection N(0, 1 / D) so pooled vectors
        keep their scale; mask embeddings N(0, 0.02) (MAE); norms one, biases zero, temperatures as
        configured. Parameters are drawn in registration order from one CPU generator.
        """
        generator = torch.Generator().manual_seed(seed)
        scale = self.tower.residual_scale()
        norms = (nn.RMSNorm, nn.LayerNorm, nn.GroupNorm)
        for module_name, module in self.named_modules():
            if module is self.temperatures or module is self.late_temperatures:
                continue
            for name, p in module.named_parameters(recurse=False):
                full = f"{module_name}.{name}" if module_name else name
                if isinstance(module, norms):
                    p.fill_(1.0 if name == "weight" else 0.0)
                elif name == "bias":
                    p.zero_()
                else:
                    std = 0.02
                    if full.endswith(("out.weight", "down.weight")):
                        std *= scale
                    elif full.startswith("pooled."):
                        std = 1.0 / math.sqrt(p.shape[1])
                    p.copy_(torch.randn(p.shape, generator=generator) * std)

    def rotary(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The rotary code (cos, sin) [R, C, 1, K/2] of axial positions [R, C, 3], in `dtype`."""
        cos, sin = self.tower.rotary(positions)
        return cos.to(dtype), sin.to(dtype)

    def states(self, batch: DeviceBatch) -> Tensor:
        """Final-norm states [R, C, D] of a prepared batch: token embeddings, each media unit's embedding
        added at its position, the rotary code `batch.cos` / `batch.sin`, the attention of `batch.mask`."""
        x = self.embed(batch.tokens)  # [R, C, D]
        rows, columns, hidden = x.shape
        for kind, media in self.media.items():
            parts = batch.media[kind]
            units = media(parts.values, parts.masked)  # [U, D]
            units = units * parts.valid.unsqueeze(1).to(units.dtype)  # inert padding units add 0
            x = x.reshape(-1, hidden).index_add(0, parts.index, units.to(x.dtype)).view(rows, columns, hidden)
        return self.tower(x, batch.cos, batch.sin, batch.mask)

    def losses(
        self,
        batch: DeviceBatch,
        world: Peers | None = None,
        positives: int | None = None,
        late_positives: int | None = None,
    ) -> Losses:
        """Every term of the objective, as `Term`s (sum, count), plus the scored embeddings [S, D].

        `world` is the world every contrastive anchor is scored against (None: this process alone);
        `positives` and `late_positives` bound the positives per row of the pooled and the late-interaction
        terms for the ranked form (see `losses.contrastive.pair_loss`).
        """
        return self.heads(self.states(batch), batch, world, positives, late_positives)

    def heads(
        self,
        states: Tensor,
        batch: DeviceBatch,
        world: Peers | None = None,
        positives: int | None = None,
        late_positives: int | None = None,
    ) -> Losses:
        """`losses` from the final-norm states [R, C, D] on: every head and loss term (a step of a world
        compiles this part on its own, apart from the tower's blocks). A term that is not a `Term` is
        refused (TypeError): the world reduction tells the counts by their type."""
        config = self.config
        hidden = states.shape[-1]
        zero = states.new_zeros((), dtype=torch.float32)
        out: dict[str, Term] = {}
        for kind, head in self.reconstruct.items():
            if config.objective == Objective.Contrastive:
                out[f"masked_{kind}"] = Term(zero, zero)
                continue
            parts = batch.media[kind]
            at = states.reshape(-1, hidden)[parts.index]  # [U, D]
            out[f"masked_{kind}"] = masked_units_sum(head(at), parts.values, parts.masked)
        if config.objective != Objective.Contrastive:
            flat = states.reshape(-1, states.shape[-1])  # [R*C, D]
            logits = self.text_head(flat[batch.target_index])  # [P, 256]
            out["masked_text"] = masked_text_sum(logits, batch.targets, batch.target_weight)
        else:
            out["masked_text"] = Term(zero, zero)
        pooled = self.pooled(states, batch.segments, batch.counts).float()  # [S, D]
        if config.objective != Objective.Masked:
            c = config.contrastive
            z, w, columns, column_valid = batch.z, batch.w, None, None
            if world is not None and world.size > 1:
                # This process's rows against every process's columns: [S, W * S] scores, never [W S, W S].
                columns = world.gather_with_grad(pooled)  # [W * S, D]
                column_valid = world.gather(batch.slot_valid.to(torch.uint8)).bool()  # [W * S]
                ambient = c.negatives == Negatives.Ambient
                z, w = world_pairs(z, w, world.rank, world.size, ambient, c.ambient_repulsion_weight)
            out["contrastive"] = contrastive_term(
                pooled,
                batch.slot_valid,
                batch.slot_group,
                self.temperatures.log_inverse_temperature,
                self.temperatures.bias,
                z,
                w,
                list(c.matryoshka_dimensions),
                c.pair_loss,
                columns=columns,
                column_valid=column_valid,
                positives=positives if c.pair_loss == PairLossForm.Ranked else None,
            )
        else:
            out["contrastive"] = Term(zero, zero)
        if self.token_head is not None and self.late_temperatures is not None:
            out["late_interaction"] = self._late(states, batch, late_positives)
        if config.choices.weight > 0:
            if batch.choice is None:
                raise ValueError("Network.losses: batch.choice is None, but the run trains choices")
            flat = states.reshape(-1, hidden)
            choice = batch.choice
            logits = self.text_head(flat[choice.index])  # [S, 256]
            out["choices"] = choices_sum(logits, choice.bytes, choice.legal, choice.targets, choice.valid)
        for name, term in out.items():
            check_term(name, term)
        return Losses(out, F.normalize(pooled.detach(), dim=-1))

    def _late(self, states: Tensor, batch: DeviceBatch, positives: int | None) -> Term:
        """The late-interaction term (sum, anchors) off the final-norm states [R, C, D]."""
        assert self.token_head is not None and self.late_temperatures is not None
        if batch.late is None:
            raise ValueError("Network.losses: batch.late is None, but the run trains late interaction")
        late = batch.late
        li = self.config.late_interaction
        flat = states.reshape(-1, states.shape[-1])  # [R*C, D]
        slots = late.z.shape[0]
        columns = late.z.shape[1]
        query_slot, document_of = late.query_slot, late.document_of
        # Capacity padding reads position 0 and is zeroed; it belongs to no slot and no column.
        queries = self.token_head(flat[late.query_index])  # [Qt, W]
        queries = queries * (query_slot < slots).unsqueeze(1).to(queries.dtype)
        documents = self.token_head(flat[late.document_index])  # [Dt, W]
        documents = documents * (document_of < columns).unsqueeze(1).to(documents.dtype)
        return late_interaction_term(
            queries,
            query_slot,
            documents,
            document_of,
            batch.slot_group,
            self.late_temperatures.log_inverse_temperature,
            self.late_temperatures.bias,
            late.z,
            late.w,
            li.pair_loss,
            positives=positives if li.pair_loss == PairLossForm.Ranked else None,
            longest=self.config.batch.max_columns_per_row - 1,  # a document is at most one row past its prefix
        )

    def total(self, terms: dict[str, Term]) -> dict[str, Tensor]:
        """The per-term means (each sum over its count, clamped at 1: the world's where the counts were
        reduced) and the weighted total the step minimises (docs/design.md §5)."""
        masking = self.config.masking

        def mean(name: str) -> Tensor:
            term = check_term(name, terms[name])
            return term.sum / term.count.clamp_min(1)

        text = mean("masked_text")
        contrastive = mean("contrastive")
        out = {"masked_text_loss": text, "contrastive_loss": contrastive}
        loss = contrastive + masking.text_weight * text
        for kind in self.reconstruct:
            term = mean(f"masked_{kind}")
            out[f"masked_{kind}_loss"] = term
            loss = loss + getattr(masking, f"{kind}_weight") * term
        if "late_interaction" in terms:  # reported weighted, as UForm 4's trainer API reports it
            late = mean("late_interaction")
            out["late_interaction_loss"] = self.config.late_interaction.weight * late
            loss = loss + out["late_interaction_loss"]
        if "choices" in terms:  # reported before its weight
            out["choices_loss"] = mean("choices")
            loss = loss + self.config.choices.weight * out["choices_loss"]
        out["loss"] = loss
        return out
