"""Qwen3.5's language model, dense (`qwen3_5`) and MoE (`qwen3_5_moe`): Qwen3-Next's blocks with
Qwen3.5's projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a: `GatedDeltaNet.packed_parts`).
A multimodal checkpoint's vision tower is not loaded; text positions make its multimodal rotary
the plain one (every section reads the same position)."""

from __future__ import annotations

from engram.models.qwen3_next import Qwen3NextForCausalLM


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    ignored_weights = (r"^mtp\.", r"^model\.visual\.")

    @staticmethod
    def renormalizes_topk(cfg: dict) -> bool:
        return True  # transformers' Qwen3.5 MoE router always does
