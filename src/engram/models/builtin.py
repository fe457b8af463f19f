"""The models that ship with the package, by name: what `--model-path embedded|demo` and no
`--model-path` at all resolve to. Each is an ordinary checkpoint folder, loaded like any other."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engram.models.embedded import EMBEDDED_MODEL_NAME, ensure_embedded_model
from engram.models.spec import ConfigError

DEMO_MODEL_DIR = Path(__file__).parent / "demo"
DEMO_MODEL_NAME = "engram-demo-stdlib"
DEFAULT_MODEL = "demo"


@dataclass(frozen=True)
class ResolvedModel:
    path: str
    served_name: str | None  # None: the folder's name, as for any checkpoint


def resolve_model(model_path: str | None) -> ResolvedModel:
    """An existing folder wins over a built-in of the same name, as in transformers' from_pretrained."""
    name = DEFAULT_MODEL if model_path is None else model_path
    if model_path is not None and Path(model_path).exists():
        return ResolvedModel(model_path, None)
    if name == "embedded":
        return ResolvedModel(str(ensure_embedded_model()), EMBEDDED_MODEL_NAME)
    if name == "demo":
        if not (DEMO_MODEL_DIR / "model.safetensors").is_file():
            raise ConfigError(
                f"the demo model's weights are not in {DEMO_MODEL_DIR}: write them with `python scripts/train_demo_model.py --out {DEMO_MODEL_DIR}`"
            )
        return ResolvedModel(str(DEMO_MODEL_DIR), DEMO_MODEL_NAME)
    return ResolvedModel(name, None)
