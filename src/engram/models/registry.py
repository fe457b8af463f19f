"""model_type -> engine model class."""

from __future__ import annotations

from engram.models.bamba import BambaForCausalLM
from engram.models.base import CausalLM
from engram.models.falcon_h1 import FalconH1ForCausalLM
from engram.models.granitemoehybrid import GraniteMoeHybridForCausalLM
from engram.models.mamba2 import Mamba2ForCausalLM
from engram.models.nemotron_h import NemotronHForCausalLM
from engram.models.spec import ModelSpec

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "mamba2": Mamba2ForCausalLM,
    "granitemoehybrid": GraniteMoeHybridForCausalLM,
    "nemotron_h": NemotronHForCausalLM,
    "bamba": BambaForCausalLM,
    "falcon_h1": FalconH1ForCausalLM,
}


def model_class(spec: ModelSpec) -> type[CausalLM]:
    return MODEL_CLASSES[spec.model_type]
