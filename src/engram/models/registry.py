"""model_type -> engine model class."""

from __future__ import annotations

from engram.models.bamba import BambaForCausalLM
from engram.models.base import CausalLM
from engram.models.falcon_h1 import FalconH1ForCausalLM
from engram.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from engram.models.kimi_linear import KimiLinearForCausalLM
from engram.models.lfm2 import Lfm2ForCausalLM
from engram.models.mamba2 import Mamba2ForCausalLM
from engram.models.nemotron_h import NemotronHForCausalLM
from engram.models.qwen3_5 import Qwen3_5ForCausalLM
from engram.models.qwen3_next import Qwen3NextForCausalLM
from engram.models.spec import ModelSpec

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "mamba2": Mamba2ForCausalLM,
    "granitemoehybrid": GraniteMoeHybridForCausalLM,
    "nemotron_h": NemotronHForCausalLM,
    "bamba": BambaForCausalLM,
    "falcon_h1": FalconH1ForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5": Qwen3_5ForCausalLM,
    "qwen3_5_text": Qwen3_5ForCausalLM,
    "qwen3_5_moe": Qwen3_5ForCausalLM,
    "qwen3_5_moe_text": Qwen3_5ForCausalLM,
    "lfm2": Lfm2ForCausalLM,
    "kimi_linear": KimiLinearForCausalLM,
}


def model_class(spec: ModelSpec) -> type[CausalLM]:
    return MODEL_CLASSES[spec.model_type]
