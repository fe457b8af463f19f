"""The memory budget: how device memory splits into weights, scratch, recurrent state and KV pages.

Order matters (DESIGN.md, "Memory"): weights, then a fixed forward scratch, then
`max_running_requests x state_bytes_per_seq` *reserved* for the running sequences, then KV pages
from what is left. Sizing the KV cache first and the state afterwards reports a healthy start and
then runs out of memory on the first full batch. `plan_memory` is the one budget function used by
engine startup, KV auto-sizing and `engram plan`; all shapes come from `ModelSpec` through
`expected_tensors`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engram.args import EngineArgs
from engram.engine.spec_config import speculative_tokens
from engram.layers.parallel import TensorParallel
from engram.models.loader import empty_model
from engram.models.registry import model_class
from engram.models.spec import ModelSpec, load_model_spec
from engram.state.identity import safetensors_header
from engram.state.sequence_state import StateDtypes, expected_tensors

GiB = 1 << 30
MiB = 1 << 20

# Kept free on top of the pools: allocator fragmentation and the small buffers that live outside
# them (block tables, sampler state, CUDA graph pools).
DEFAULT_MARGIN_BYTES = 256 * MiB

# Forward scratch estimate (see `scratch_bytes`): live copies of the widest per-token activation.
ACTIVATION_COPIES = 4
# Logits and the sampler's probabilities, float32, one row per running sequence.
LOGIT_COPIES = 2

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MemoryPlanError(ValueError):
    """The configuration does not fit in memory; the message names the flag to change."""


def resolve_dtype(name: str, flag: str, auto: torch.dtype | None = None) -> torch.dtype:
    """Parse a dtype name; `auto` stands for `auto` when given. Errors name `flag`."""
    if name == "auto" and auto is not None:
        return auto
    if name not in DTYPES:
        choices = ", ".join((["auto"] if auto is not None else []) + list(DTYPES))
        raise ValueError(f"{flag}: unknown dtype {name!r}; choose one of {choices}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def state_dtypes(spec: ModelSpec, model_dtype: torch.dtype, mamba_ssm_dtype: str, kv_cache_dtype: str) -> StateDtypes:
    """Dtypes of the state tensors: conv state in the model dtype, SSM and KV as configured."""
    return StateDtypes(
        conv=model_dtype,
        ssm=resolve_dtype(mamba_ssm_dtype, "--mamba-ssm-dtype", model_dtype),
        kv=resolve_dtype(kv_cache_dtype, "--kv-cache-dtype", model_dtype),
    )


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _total_bytes(spec: ModelSpec, dtypes: StateDtypes, state_len: int) -> int:
    return sum(_nbytes(shape, dtype) for shape, dtype in expected_tensors(spec, dtypes, state_len).values())


def state_bytes_by_kind(spec: ModelSpec, dtypes: StateDtypes) -> dict[str, int]:
    """Fixed per-sequence state bytes keyed `<mixer kind>.<tensor>`, e.g. `mamba.ssm`: what each
    layer's mixers declare (attention KV grows with the length and is not in it)."""
    out: dict[str, int] = {}
    for layer in range(spec.num_layers):
        for kind in spec.mixers(layer):
            for t in spec.mixer_state_tensors(kind):
                key = f"{kind.value}.{t.suffix}"
                out[key] = out.get(key, 0) + _nbytes(t.shape, dtypes.of(t.role))
    return out


def state_bytes_per_seq(spec: ModelSpec, dtypes: StateDtypes) -> int:
    """Recurrent state one running sequence holds whatever its length (0 without recurrent layers)."""
    return _total_bytes(spec, dtypes, 0)


def kv_bytes_per_token(spec: ModelSpec, dtypes: StateDtypes) -> int:
    """KV bytes one token adds: 2 x attention layers x kv_heads x head_dim x itemsize."""
    return _total_bytes(spec, dtypes, 1) - _total_bytes(spec, dtypes, 0)


def weight_files(model_path: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: those of the index when there is one, else all of them.

    `model_path` is a folder or a `config.json` file (whose folder is searched).
    """
    path = Path(model_path)
    folder = path if path.is_dir() else path.parent
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(folder.glob("*.safetensors"))


def _safetensors_numel(files: list[Path], skip: set[str], ignored: tuple[str, ...] = ()) -> int:
    """Element count from the files' headers (8-byte little-endian length, then JSON); no data is read.
    Tensors named in `skip` or matching a regex of `ignored` (not loaded: a vision tower, MTP layers) are left out."""
    total = 0
    for file in files:
        with file.open("rb") as f:
            header = json.loads(safetensors_header(f))
        total += sum(
            math.prod(t["shape"])
            for name, t in header.items()
            if name != "__metadata__" and name not in skip and not any(re.search(p, name) for p in ignored)
        )
    return total


def _config_numel(spec: ModelSpec) -> int:
    """Element count of the transformers model built on the meta device (no memory, no download).

    Parameters are deduplicated, so tied embeddings count once; persistent buffers (stored in
    checkpoints, e.g. router biases) count too.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in spec.config.items() if k != "model_type"}
    config = AutoConfig.for_model(spec.config["model_type"], **fields)  # a multimodal checkpoint's text model
    with torch.device("meta"):
        model: torch.nn.Module = AutoModelForCausalLM.from_config(config)
    persistent = set(model.state_dict())
    buffers = sum(b.numel() for name, b in model.named_buffers() if name in persistent)
    return sum(p.numel() for p in model.parameters()) + buffers


def weights_bytes(model_path: str | Path, dtype: torch.dtype) -> int:
    """Bytes of the weights once loaded in `dtype` (every tensor is converted to the serving dtype).

    From the safetensors headers when the folder has weights, else counted from `config.json`.
    """
    spec = load_model_spec(model_path)
    files = weight_files(model_path)
    if files:
        skip = {"lm_head.weight"} if spec.tie_word_embeddings else set()
        return _safetensors_numel(files, skip, model_class(spec).ignored_weights) * dtype.itemsize
    return _config_numel(spec) * dtype.itemsize


def weights_bytes_per_rank(total: int, spec: ModelSpec, size: int) -> int:
    """One tensor-parallel rank's share of `total` weight bytes: scaled by the part of the model's
    parameters rank 0 holds (both counted on the meta device), as embeddings, norms and routers are
    whole on every rank. A split that does not divide raises ConfigError."""
    if size == 1:
        return total
    whole, share = (
        sum(p.numel() for p in empty_model(spec, torch.float32, torch.device("meta"), tp).parameters()) for tp in (None, TensorParallel(0, size))
    )
    return math.ceil(total * share / whole)


def _widest_activation(spec: ModelSpec) -> int:
    widths = [spec.hidden_size]
    if spec.mamba is not None:
        m = spec.mamba
        widths.append(2 * m.intermediate_size + 2 * m.n_groups * m.state_size + m.num_heads)  # in_proj
    widths += [delta.in_proj_size for delta in (spec.gated_deltanet, spec.kda) if delta is not None]
    if spec.short_conv is not None:
        widths.append(3 * spec.short_conv.hidden_size)  # in_proj: B, C, x
    if spec.attention is not None:
        a = spec.attention
        widths.append((a.num_heads + 2 * a.num_kv_heads) * a.head_dim)  # q, k, v
    return max(widths)


def scratch_bytes(spec: ModelSpec, max_num_batched_tokens: int, max_running_requests: int, dtype: torch.dtype) -> int:
    """A fixed estimate of the activations of one forward step (one layer's worth is live at once).

    - `ACTIVATION_COPIES` copies of the widest per-token projection (Mamba in_proj or q/k/v) for
      every batched token, in the model dtype;
    - the chunked scan's float32 state at each chunk boundary (Mamba2's SSD, the gated delta rule);
    - float32 logits and probabilities over the vocabulary for each running sequence (only the
      last position of a sequence is projected to the vocabulary).
    """
    projections = ACTIVATION_COPIES * max_num_batched_tokens * _widest_activation(spec) * dtype.itemsize
    scan = 0
    if spec.mamba is not None:
        chunks = math.ceil(max_num_batched_tokens / spec.mamba.chunk_size)
        scan = chunks * _nbytes(spec.mamba.ssm_state_shape, torch.float32)
    for delta in (spec.gated_deltanet, spec.kda):  # the gated delta rule, per head or per key channel
        if delta is not None:
            scan = max(scan, math.ceil(max_num_batched_tokens / delta.chunk_size) * _nbytes(delta.recurrent_state_shape, torch.float32))
    logits = LOGIT_COPIES * max_running_requests * spec.vocab_size * torch.float32.itemsize
    return projections + scan + logits


def verify_bytes(spec: ModelSpec, dtypes: StateDtypes, max_running_requests: int, num_speculative_tokens: int) -> int:
    """A speculative step's buffers (ops/verify.py) for every running sequence: each recurrent state
    tensor's conv window or scan state after each of the k + 1 positions (`StateTensor.verify_shape`),
    and k more float32 logits rows."""
    if num_speculative_tokens == 0:
        return 0
    positions = num_speculative_tokens + 1
    per_seq = LOGIT_COPIES * num_speculative_tokens * spec.vocab_size * torch.float32.itemsize
    per_seq += sum(_nbytes(t.verify_shape(positions), dtypes.of(t.role)) for i in spec.recurrent_layers for t in spec.state_tensors(i))
    return max_running_requests * per_seq


def device_memory_bytes(device: str, cpu_memory_gb: float) -> int:
    """Total memory of a CUDA device; on CPU, where there is nothing to query, `cpu_memory_gb` GiB."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[1]
    if dev.type == "cpu":
        return int(cpu_memory_gb * GiB)
    raise ValueError(f"--device: unsupported device {device!r}")


@dataclass
class MemoryPlan:
    """Every figure of the budget, in bytes. Filled in even when it does not fit (`error` says why)."""

    total_memory_bytes: int
    mem_fraction_static: float
    budget_bytes: int  # total_memory_bytes x mem_fraction_static
    weights_bytes: int
    scratch_bytes: int
    margin_bytes: int
    state_bytes_per_seq: int
    state_bytes_by_kind: dict[str, int]  # per sequence
    max_running_requests: int
    state_cache_bytes: int  # max_running_requests x state_bytes_per_seq
    kv_bytes_per_token: int
    kv_block_size: int
    num_kv_blocks: int
    kv_cache_bytes: int
    # Tokens the KV cache holds. Without attention layers KV costs nothing and this is
    # context_length x max_running_requests (every running sequence at full length).
    max_total_tokens: int
    context_length: int
    conv_state_dtype: str
    ssm_state_dtype: str
    kv_cache_dtype: str
    shortfall_bytes: int  # how much more budget it needs to fit; 0 when it fits
    error: str | None

    @property
    def fits(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return {**vars(self), "fits": self.fits}


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def plan_memory(
    spec: ModelSpec,
    *,
    total_memory_bytes: int,
    mem_fraction_static: float,
    weights_bytes: int,
    scratch_bytes: int,
    max_running_requests: int,
    context_length: int | None,
    dtypes: StateDtypes,
    kv_block_size: int = 16,
    max_total_tokens: int | None = None,
    margin_bytes: int = DEFAULT_MARGIN_BYTES,
) -> MemoryPlan:
    """Split the budget; never raises (see `require_fit`).

    KV gets exactly `budget - weights - scratch - state reserve - margin`, rounded down to whole
    pages (at most what `max_running_requests` sequences of full length use), unless
    `max_total_tokens` fixes its size. `context_length=None` means the model's
    `max_position_embeddings`, capped by what the KV cache holds.
    """
    per_seq = state_bytes_per_seq(spec, dtypes)
    per_token = kv_bytes_per_token(spec, dtypes)
    state_cache = max_running_requests * per_seq
    budget = int(total_memory_bytes * mem_fraction_static)
    fixed = weights_bytes + scratch_bytes + margin_bytes
    kv_room = budget - fixed - state_cache
    page_bytes = kv_block_size * per_token

    if page_bytes == 0:
        context = context_length or spec.max_position_embeddings
        tokens = max_total_tokens or context * max_running_requests
        blocks = 0
    else:
        if max_total_tokens:
            blocks = math.ceil(max_total_tokens / kv_block_size)
        else:
            # No more pages than every running sequence at full length can use.
            longest = context_length or spec.max_position_embeddings
            blocks = min(max(kv_room, 0) // page_bytes, max_running_requests * math.ceil(longest / kv_block_size))
        tokens = max_total_tokens or blocks * kv_block_size
        context = context_length or min(spec.max_position_embeddings, max(tokens, kv_block_size))
    kv_cache = blocks * page_bytes
    kv_needed = kv_cache if max_total_tokens else math.ceil(context / kv_block_size) * page_bytes

    error = None
    if fixed > budget:
        error = (
            f"weights ({format_bytes(weights_bytes)}), forward scratch ({format_bytes(scratch_bytes)}) and margin "
            f"({format_bytes(margin_bytes)}) exceed the budget of {format_bytes(budget)} (device memory "
            f"{format_bytes(total_memory_bytes)} x --mem-fraction-static {mem_fraction_static}); raise "
            f"--mem-fraction-static, lower --max-num-batched-tokens or use a device with more memory"
        )
    elif kv_room < 0:
        room = (budget - fixed) // per_seq
        hint = f"lower --max-running-requests to at most {room}" if room else "not even one sequence fits"
        error = (
            f"the recurrent state of --max-running-requests {max_running_requests} sequences needs "
            f"{format_bytes(state_cache)} ({format_bytes(per_seq)} per sequence) but only {format_bytes(budget - fixed)} remain "
            f"after weights and scratch; {hint}"
        )
    elif page_bytes and max_total_tokens and max_total_tokens < context:
        error = f"--max-total-tokens {max_total_tokens} cannot hold one sequence of --context-length {context}"
    elif page_bytes and kv_cache > kv_room:
        error = (
            f"--max-total-tokens {max_total_tokens} needs {format_bytes(kv_cache)} of KV cache but only "
            f"{format_bytes(kv_room)} remain after weights, scratch and the state of --max-running-requests "
            f"{max_running_requests}; lower --max-total-tokens to at most {kv_room // page_bytes * kv_block_size}"
        )
    elif page_bytes and tokens < context:
        error = (
            f"the KV cache holds {tokens} tokens (the largest --max-total-tokens that fits), fewer than one "
            f"sequence of --context-length {context} ({format_bytes(kv_needed)}); lower --context-length or "
            f"--max-running-requests"
        )

    return MemoryPlan(
        total_memory_bytes=total_memory_bytes,
        mem_fraction_static=mem_fraction_static,
        budget_bytes=budget,
        weights_bytes=weights_bytes,
        scratch_bytes=scratch_bytes,
        margin_bytes=margin_bytes,
        state_bytes_per_seq=per_seq,
        state_bytes_by_kind=state_bytes_by_kind(spec, dtypes),
        max_running_requests=max_running_requests,
        state_cache_bytes=state_cache,
        kv_bytes_per_token=per_token,
        kv_block_size=kv_block_size,
        num_kv_blocks=blocks,
        kv_cache_bytes=kv_cache,
        max_total_tokens=tokens,
        context_length=context,
        conv_state_dtype=dtype_name(dtypes.conv),
        ssm_state_dtype=dtype_name(dtypes.ssm),
        kv_cache_dtype=dtype_name(dtypes.kv),
        shortfall_bytes=max(0, fixed + state_cache + kv_needed - budget),
        error=error,
    )


def plan_for_args(
    spec: ModelSpec, args: EngineArgs, *, model_dtype: torch.dtype, total_memory_bytes: int, weights_bytes: int, cuda_graphs: bool
) -> MemoryPlan:
    """`plan_memory` for an engine configuration: the same figures at startup and in `engram plan`.
    With `cuda_graphs` (the engine will capture steps), the forward scratch counts twice: a captured
    step's activations stay in the graphs' private pool (prefill graphs reach the step's token
    budget), beside the allocator's own for the eager steps."""
    dtypes = state_dtypes(spec, model_dtype, args.mamba_ssm_dtype, args.kv_cache_dtype)
    scratch_copies = 2 if cuda_graphs else 1
    return plan_memory(
        spec,
        total_memory_bytes=total_memory_bytes,
        mem_fraction_static=args.mem_fraction_static,
        weights_bytes=weights_bytes,
        scratch_bytes=scratch_copies * scratch_bytes(spec, args.max_num_batched_tokens, args.max_running_requests, model_dtype)
        + verify_bytes(spec, dtypes, args.max_running_requests, speculative_tokens(args.speculative_config)),
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        dtypes=dtypes,
        kv_block_size=args.kv_block_size,
        max_total_tokens=args.max_total_tokens,
    )


def require_fit(plan: MemoryPlan) -> MemoryPlan:
    """Return the plan, or raise `MemoryPlanError` with its flag-naming message."""
    if plan.error is not None:
        raise MemoryPlanError(plan.error)
    return plan
