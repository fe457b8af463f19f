"""What every architecture shares: embed -> blocks -> final norm -> LM head, and weight renaming.

Internal parameter names are uniform (`embed_tokens`, `layers.<i>.input_norm`, `layers.<i>.mixer`,
`norm`, `lm_head`); each architecture lists regex rules from its checkpoint names to them.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from engram.cache.forward_batch import ForwardBatch
from engram.layers import parallel
from engram.layers.attention import Attention
from engram.layers.gated_deltanet import GatedDeltaNet
from engram.layers.kimi_delta import KimiDeltaAttention
from engram.layers.latent_attention import LatentAttention
from engram.layers.mamba2 import Mamba2Mixer
from engram.layers.norm import RMSNorm
from engram.layers.parallel import Shard
from engram.layers.short_conv import ShortConv
from engram.models.spec import LayerKind, ModelSpec

# (checkpoint-name pattern, internal name template). A template ending in "[i]" names a stacked
# [experts, ...] parameter; the tensor is its row given by the pattern's group `expert`.
RenameRules = list[tuple[str, str]]
# Where a checkpoint tensor lands: an internal parameter, and its row (an expert), rows (a part of
# a packed projection: a slice, or an index tensor for interleaved parts), an expert's rows
# (expert, slice), or None for the whole parameter.
WeightRows = int | slice | tuple[int, slice] | torch.Tensor
WeightPlace = tuple[str, WeightRows | None]


def sequence_mixer(spec: ModelSpec, index: int) -> nn.Module:
    """The token mixer of a layer that has one: Mamba2, gated DeltaNet, Kimi Delta Attention, short
    conv or attention (latent attention where its spec has a latent)."""
    (kind,) = spec.mixers(index)
    if kind == LayerKind.MAMBA:
        assert spec.mamba is not None, "a Mamba layer's spec has its dimensions"
        return Mamba2Mixer(spec.mamba, spec.hidden_size, index)
    if kind == LayerKind.GATED_DELTANET:
        assert spec.gated_deltanet is not None, "a gated DeltaNet layer's spec has its dimensions"
        return GatedDeltaNet(spec.gated_deltanet, spec.hidden_size, index)
    if kind == LayerKind.KDA:
        assert spec.kda is not None, "a Kimi Delta Attention layer's spec has its dimensions"
        return KimiDeltaAttention(spec.kda, spec.hidden_size, index)
    if kind == LayerKind.SHORT_CONV:
        assert spec.short_conv is not None, "a short-conv layer's spec has its dimensions"
        return ShortConv(spec.short_conv, index)
    assert kind == LayerKind.ATTENTION and spec.attention is not None, f"{kind.value} is no sequence mixer with dimensions"
    if spec.attention.latent is not None:
        return LatentAttention(spec.attention, spec.hidden_size, index)
    return Attention(spec.attention, spec.hidden_size, index)


class CausalLM(nn.Module):
    rename_rules: RenameRules = []
    ignored_weights: tuple[str, ...] = ()  # regexes of checkpoint tensors the engine does not use
    # Experts whose gate and up projections the checkpoint keeps apart, each loaded into its half of
    # the expert's rows of a stacked [experts, 2 x width, hidden] parameter: a pattern with groups
    # `expert` and `half`, the stacked parameter's template, and the name of the first (gate) half.
    expert_halves: tuple[str, str, str] | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0  # scales each block's output added to the residual stream
    logits_scaling: float = 1.0

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        building = parallel.current()
        self.tensor_parallel_size = building.size if building is not None else 1
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.tie_weights()
        self.layers = nn.ModuleList()
        self.norm: RMSNorm

    def after_load(self) -> None:
        """Called once the checkpoint's weights are in place (Falcon-H1 folds its multipliers into them)."""

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (again after `to_empty`, which unties them)."""
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    if TYPE_CHECKING:  # nn.Module types its __call__ as returning Any; a call runs `forward`

        def __call__(self, batch: ForwardBatch) -> torch.Tensor: ...

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Next-token logits for the rows `batch.logits_indices`, in the LM head's dtype (float32
        when the model scales them)."""
        return self.compute_logits(self.final_hidden(batch))

    def final_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """The last hidden states (after the final norm) of the rows `batch.logits_indices`.

        Each block takes and returns (output, residual stream): a block's output is added to the
        stream by the next block's first norm, in one fused kernel (`RMSNorm.add_and_norm`)."""
        hidden = self.embed_tokens(batch.input_ids)
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, batch)
        assert residual is not None, "a model has at least one layer"
        rows = batch.logits_indices
        if rows.numel() < hidden.shape[0]:  # the indices increase: as many as rows means every row (decode)
            hidden, residual = hidden[rows], residual[rows]
        if residual.dtype == hidden.dtype:
            hidden, _ = self.norm.add_and_norm(hidden, residual, self.residual_multiplier)
            return hidden
        # a float32 stream (Mamba2) is normalized in float32, not in the fused op's activation dtype
        return self.norm(residual + (hidden if self.residual_multiplier == 1.0 else hidden * self.residual_multiplier))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states. In the head's dtype unless scaled: the sampler widens
        what it computes on, and a greedy step's argmax needs no float32 copy (17 us of a batch-64
        step on the H200)."""
        logits = self.lm_head(hidden.to(self.lm_head.weight.dtype))
        return logits.float() / self.logits_scaling if self.logits_scaling != 1.0 else logits

    def map_weight_name(self, name: str) -> WeightPlace | None:
        """Checkpoint tensor name -> its place in the model; None to skip it."""
        half = self.expert_half(name)
        if half is not None:
            stacked, expert, second = half
            size = self.get_parameter(stacked).shape[-2] // 2  # this rank's width
            return stacked, (expert, slice(second * size, (second + 1) * size))
        internal = self._internal_name(name)
        if internal is None:
            return None
        if internal[1] is not None:
            return internal
        return self._packed_place(internal[0])

    def expert_half(self, name: str) -> tuple[str, int, int] | None:
        """(stacked parameter, expert, 0 for the gate half or 1 for the up half) of an expert's gate
        or up projection; None for any other tensor, and for one naming a layer without experts
        (the loader then says it has no place)."""
        m = re.fullmatch(self.expert_halves[0], name) if self.expert_halves is not None else None
        if m is None:
            return None
        assert self.expert_halves is not None
        stacked = m.expand(self.expert_halves[1])
        try:
            self.get_parameter(stacked)
        except AttributeError:
            return None
        return stacked, int(m["expert"]), int(m["half"] != self.expert_halves[2])

    def _internal_name(self, name: str) -> tuple[str, int | None] | None:
        """Checkpoint tensor name -> (internal name, expert row or None), before packed parts are placed."""
        if any(re.search(p, name) for p in self.ignored_weights):
            return None
        for pattern, template in self.rename_rules:
            m = re.fullmatch(pattern, name)
            if m:
                if template.endswith("[i]"):
                    return m.expand(template[:-3]), int(m.group("expert"))
                return m.expand(template), None
        return name, None

    def weight_shard(self, name: str) -> Shard | None:
        """The part of checkpoint tensor `name` this rank keeps (None: all of it, as without
        tensor parallelism), as the module it lands in declares (`tp_shards`)."""
        internal = self._internal_name(name) if self.tensor_parallel_size > 1 else None
        if internal is None:
            return None
        parts = internal[0].split(".")
        for cut in range(len(parts) - 1, 0, -1):
            try:
                module = self.get_submodule(".".join(parts[:cut]))
            except AttributeError:
                continue
            shards = getattr(module, "tp_shards", None)
            if shards is not None and getattr(module, "tp", None) is not None:
                return shards().get(".".join(parts[cut:]))
        return None

    def state_shards(self, rank: int) -> dict[str, Shard]:
        """Rank `rank`'s part of every per-sequence state tensor (recurrent state and KV rows), by
        snapshot name; empty without tensor parallelism."""
        shards: dict[str, Shard] = {}
        for module in self.modules():
            of_rank = getattr(module, "state_shards", None)
            if of_rank is not None and getattr(module, "tp", None) is not None:
                shards.update(of_rank(rank))
        return shards

    def _packed_place(self, internal: str) -> WeightPlace:
        """A part of a packed parameter (a module's `packed_parts`, e.g. attention's q, k and v in
        one projection) goes to its rows there."""
        module_name, _, part = internal.rpartition(".")
        module_name, _, proj = module_name.rpartition(".")
        try:
            module = self.get_submodule(module_name)
        except AttributeError:  # no such module: the loader reports the tensor as having no place
            return internal, None
        packed = getattr(module, "packed_parts", None)
        place = packed().get(f"{proj}.{part}") if packed is not None else None
        if place is None:
            return internal, None
        return f"{module_name}.{place[0]}", place[1]
