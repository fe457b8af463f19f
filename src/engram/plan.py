"""`engram plan`: the memory budget of a configuration, without loading weights or touching a GPU.

The engine flags it shares with `engram serve` come from `EngineArgs` (same names, defaults and
help), and the figures come from the same `plan_for_args` the engine calls at startup.
`--dtype auto` means the config's `torch_dtype` (bfloat16 when it has none). Exit status: 0 when
the configuration fits, 1 when it does not (everything is still printed), 2 on a bad config or flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing

from engram.args import EngineArgs, add_dataclass_args, from_namespace
from engram.engine.memory_planner import (
    GiB,
    MemoryPlan,
    dtype_name,
    format_bytes,
    plan_for_args,
    resolve_dtype,
    weight_files,
    weights_bytes,
    weights_bytes_per_rank,
)
from engram.layers.parallel import local_spec
from engram.models.spec import ModelSpec, load_model_spec

_ENGINE_FLAGS = (
    "mem_fraction_static",
    "max_running_requests",
    "max_num_batched_tokens",
    "context_length",
    "max_total_tokens",
    "kv_block_size",
    "mamba_ssm_dtype",
    "kv_cache_dtype",
    "speculative_config",
    "tensor_parallel_size",
    "enable_cuda_graph",
)


def _engine_flags() -> type:
    """A dataclass holding the `EngineArgs` fields that bear on memory, for `add_dataclass_args`."""
    hints = typing.get_type_hints(EngineArgs)
    return dataclasses.make_dataclass(
        "PlanEngineArgs",
        [
            (f.name, hints[f.name], dataclasses.field(default=f.default, metadata=f.metadata))
            for f in dataclasses.fields(EngineArgs)
            if f.name in _ENGINE_FLAGS
        ],
    )


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", required=True, help="checkpoint folder, or a config.json file")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0, help="device memory in GiB (default: 80)")
    parser.add_argument("--dtype", default="auto", help="auto (the config's torch_dtype, else bfloat16)|float32|bfloat16|float16")
    add_dataclass_args(parser, _engine_flags())
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (exact byte counts)")


def _report(spec: ModelSpec, plan: MemoryPlan, info: dict) -> str:
    kinds = ", ".join(f"{spec.layout().count(k)} {k}" for k in dict.fromkeys(spec.layout()))
    rows = [
        ("device memory", format_bytes(plan.total_memory_bytes), ""),
        ("budget", format_bytes(plan.budget_bytes), f"x --mem-fraction-static {plan.mem_fraction_static}"),
        ("weights", format_bytes(plan.weights_bytes), f"{info['dtype']}, from {info['weights_source']}"),
        ("forward scratch", format_bytes(plan.scratch_bytes), f"{info['max_num_batched_tokens']} batched tokens"),
        ("margin", format_bytes(plan.margin_bytes), ""),
        ("state cache", format_bytes(plan.state_cache_bytes), f"{plan.max_running_requests} x {format_bytes(plan.state_bytes_per_seq)} per sequence"),
        *((f"  {kind}", format_bytes(n), "per sequence") for kind, n in plan.state_bytes_by_kind.items()),
        ("KV per token", format_bytes(plan.kv_bytes_per_token), ""),
        ("KV cache", format_bytes(plan.kv_cache_bytes), f"{plan.num_kv_blocks} pages of {plan.kv_block_size} tokens"),
        ("max total tokens", f"{plan.max_total_tokens:,}", ""),
        ("context length", f"{plan.context_length:,}", ""),
    ]
    width = max(18, *(len(name) + 2 for name, _, _ in rows))
    lines = [
        f"{spec.architecture} ({spec.model_type}) from {info['model_path']}",
        f"layers: {kinds}",
        *(
            [f"per rank of --tensor-parallel-size {info['tensor_parallel_size']} (device memory is each rank's)"]
            if info["tensor_parallel_size"] > 1
            else []
        ),
        f"dtypes: weights {info['dtype']}, conv state {plan.conv_state_dtype}, ssm state {plan.ssm_state_dtype}, kv cache {plan.kv_cache_dtype}",
        "",
        *(f"  {name:<{width}}{value:>14}   {note}".rstrip() for name, value, note in rows),
        "",
    ]
    if plan.fits:
        lines.append("fits: yes")
    else:
        lines += [f"fits: NO, short by {format_bytes(plan.shortfall_bytes)}", f"error: {plan.error}"]
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    try:
        spec = load_model_spec(args.model_path)
        dtype = resolve_dtype(args.dtype, "--dtype", resolve_dtype(spec.torch_dtype or "bfloat16", "config.json torch_dtype"))
        size = args.tensor_parallel_size
        if size < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {size}")
        plan = plan_for_args(  # one rank's share: its weights, its part of every state, on its own device
            local_spec(spec, size),
            from_namespace(EngineArgs, args),
            model_dtype=dtype,
            total_memory_bytes=int(args.gpu_memory_gb * GiB),
            weights_bytes=weights_bytes_per_rank(weights_bytes(args.model_path, dtype), spec, size),
            cuda_graphs=args.enable_cuda_graph and size == 1,  # as the engine captures on a GPU
        )
    except ValueError as e:  # ConfigError, unknown dtype names
        print(f"engram plan: {e}", file=sys.stderr)
        return 2
    info = {
        "model_path": str(args.model_path),
        "architecture": spec.architecture,
        "dtype": dtype_name(dtype),
        "weights_source": "safetensors" if weight_files(args.model_path) else "config.json",
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    print(json.dumps({**info, **plan.to_dict()}, indent=2) if args.json else _report(spec, plan, info))
    return 0 if plan.fits else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="engram plan", description=__doc__.splitlines()[0])
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
