"""Build a model from a checkpoint folder: single or sharded safetensors, tied embeddings, dtype."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from engram.layers.parallel import Shard, TensorParallel, building
from engram.models.base import CausalLM
from engram.models.registry import model_class
from engram.models.spec import ModelSpec


class WeightLoadError(ValueError):
    pass


def safetensors_files(model_path: Path) -> list[Path]:
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {model_path}")
    return files


# A checkpoint tensor's getter: the whole tensor, or (tensor parallelism) only a shard of it.
Getter = Callable[[Shard | None], torch.Tensor]


def empty_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device, tp: TensorParallel | None = None) -> CausalLM:
    """The model's modules with uninitialized parameters (on the meta device: none allocated);
    with `tp`, rank `tp.rank`'s share only (a split that does not divide raises ConfigError)."""
    with torch.device("meta"), building(tp):
        model = model_class(spec)(spec)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    return model


def _fill(model: CausalLM, spec: ModelSpec, tensors: Iterable[tuple[str, str, Getter]]) -> CausalLM:
    """Copy checkpoint tensors (source name, tensor name, getter) into the model's parameters;
    under tensor parallelism, each only in the part this rank holds."""
    params: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    params.update(model.named_buffers(remove_duplicate=False))
    loaded: set[str] = set()
    # parameters filled by parts (experts, packed projections): which of their rows (all dims but the
    # last; a bias's elements) are in
    rows_loaded: dict[str, torch.Tensor] = {}
    for source, name, get in tensors:
        mapped = model.map_weight_name(name)
        if mapped is None:
            continue
        target, row = mapped
        if target not in params:
            raise WeightLoadError(f"{source}: tensor {name!r} has no place in {spec.architecture} (mapped to {target!r})")
        param = params[target]
        dest = param.data if row is None else param.data[row]
        tensor = get(model.weight_shard(name))
        if tuple(tensor.shape) != tuple(dest.shape):
            raise WeightLoadError(f"{name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")
        if row is None:
            dest.copy_(tensor)
            loaded.add(target)
            continue
        # a view's copy, or the scattered rows of an index tensor (index_put_ converts neither device nor dtype)
        param.data[row] = tensor.to(device=param.device, dtype=param.dtype)
        if target not in rows_loaded:
            rows_loaded[target] = torch.zeros(param.shape[: max(param.ndim - 1, 1)], dtype=torch.bool)
        rows_loaded[target][row] = True
    partly = {}  # parameters filled by rows, some of them missing: which
    for target, filled in rows_loaded.items():
        absent = (~filled.reshape(filled.shape[0], -1).all(dim=1)).nonzero().flatten().tolist()
        if absent:
            partly[target] = f"{target} (rows {_spans(absent)})"
        else:
            loaded.add(target)
    if spec.tie_word_embeddings:
        loaded.add("lm_head.weight")
    missing = [partly.get(name, name) for name in sorted(set(params) - loaded)]
    if missing:
        raise WeightLoadError(f"checkpoint lacks weights: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    model.after_load()
    return model.eval()


def _spans(rows: list[int]) -> str:
    """Sorted row numbers as ranges: [0, 1, 2, 7] -> "0:3, 7:8"."""
    spans, start = [], rows[0]
    for prev, row in zip(rows, rows[1:] + [-1]):
        if row != prev + 1:
            spans.append(f"{start}:{prev + 1}")
            start = row
    return ", ".join(spans)


def load_model(spec: ModelSpec, model_path: str | Path, dtype: torch.dtype, device: torch.device, tp: TensorParallel | None = None) -> CausalLM:
    """The checkpoint's model; with `tp`, rank `tp.rank`'s share, each tensor read only in that part."""
    model = empty_model(spec, dtype, device, tp)
    files = safetensors_files(Path(model_path))
    total = 0
    for file in files:  # headers only: the progress bar's length
        with safe_open(file, framework="pt") as f:
            total += len(f.keys())

    def tensors():
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    yield file.name, name, functools.partial(_read, f, name)

    return _fill(model, spec, tqdm(tensors(), total=total, desc="loading weights", unit="tensor", disable=None))


def load_model_from_state_dict(spec: ModelSpec, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> CausalLM:
    """Build a model from tensors already in memory under checkpoint names (e.g. a `transformers`
    model's `state_dict()`), so that both engines run on the same weights (benchmarks, tests)."""
    model = empty_model(spec, dtype, device)
    return _fill(model, spec, (("state_dict", name, functools.partial(_part, t)) for name, t in state_dict.items()))


def _read(f, name: str, shard: Shard | None) -> torch.Tensor:
    return f.get_tensor(name) if shard is None else shard.take(f.get_slice(name))


def _part(tensor: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    return tensor if shard is None else shard.take(tensor)
