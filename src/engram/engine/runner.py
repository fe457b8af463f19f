"""Turns scheduled chunks into one flat `ForwardBatch`, runs the model, returns logits rows."""

from __future__ import annotations

import torch

from engram.engine.forward_batch import ForwardBatch
from engram.engine.pools import KVPool, StatePool
from engram.engine.scheduler import ScheduledChunk
from engram.models.base import CausalLM
from engram.ops.attention import token_slots


class ModelRunner:
    def __init__(self, model: CausalLM, state_pool: StatePool, kv_pool: KVPool, device: torch.device):
        self.model = model
        self.state_pool = state_pool
        self.kv_pool = kv_pool
        self.device = device

    def build_batch(self, chunks: list[ScheduledChunk]) -> ForwardBatch:
        dev = self.device
        input_ids, positions, slot_mapping, logits_indices = [], [], [], []
        max_blocks = max((len(c.seq.blocks) for c in chunks), default=0)
        tables = torch.full((len(chunks), max(max_blocks, 1)), -1, dtype=torch.long)
        offset = 0
        for i, c in enumerate(chunks):
            input_ids.extend(c.seq.token_ids[c.start : c.start + c.length])
            positions.append(torch.arange(c.start, c.start + c.length))
            if c.seq.blocks:
                tables[i, : len(c.seq.blocks)] = torch.tensor(c.seq.blocks)
                slot_mapping.append(token_slots(tables[i], c.start + c.length, self.kv_pool.block_size)[c.start :])
            offset += c.length
            if c.completes:
                logits_indices.append(offset - 1)
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.cat(positions).to(dev),
            seq_lens=[c.length for c in chunks],
            context_lens=[c.start for c in chunks],
            state_slots=torch.tensor([c.seq.slot for c in chunks], dtype=torch.long, device=dev),
            slot_mapping=(torch.cat(slot_mapping) if slot_mapping else torch.empty(0, dtype=torch.long)).to(dev),
            block_tables=tables.to(dev),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            state_pool=self.state_pool,
            kv_pool=self.kv_pool,
        )

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Logits [number of completing chunks, vocab] (float32, on the CPU)."""
        return self.model(self.build_batch(chunks)).cpu()
