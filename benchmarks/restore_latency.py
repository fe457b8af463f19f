"""Restore latency per state tier, next to recomputing the same history by prefill.

For each history length: prefill the history once (that time is "recompute"), then continue it
with 16 new tokens four ways, each measured as time to the first new token (each history is run
twice and the second run reported, so compilation and graph capture are not counted):

  recompute  the whole history + new tokens prefilled from nothing
  active     the finished request's engine slot adopted as it is (no copy)
  warm       the host copy loaded into the engine's pools (real tensor copies), then the new tokens
  cold       the snapshot file read and verified, loaded into the pools, then the new tokens

Weights are random, from a config.json (a transformers model is built from it and the engine runs
on the same tensors). On CPU use --scale to shrink the model to something a CPU can run.

    python benchmarks/restore_latency.py --config tests/data/configs/granite-4.0-h-tiny.json \\
        --scale cpu --histories 1024 4096 16384
    python benchmarks/restore_latency.py --config tests/data/configs/granite-4.0-h-tiny.json \\
        --device cuda --histories 1024 8192 32768 131072
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from engram.args import EngineArgs
from engram.engine.engine import LLMEngine
from engram.engine.request import SamplingParams
from engram.state.identity import ModelIdentity
from engram.state.snapshot import SnapshotMeta, load_snapshot, save_snapshot

NEW_TOKENS = 16
# A Granite-4.0-H-shaped model small enough for a CPU: same layer pattern kinds, fewer and narrower layers.
CPU_SCALE = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
    "shared_intermediate_size": 512,
    "num_local_experts": 8,
    "mamba_n_heads": 16,
    "mamba_d_head": 64,
    "mamba_d_state": 64,
    "vocab_size": 32000,
    "layer_types": ["mamba", "mamba", "mamba", "attention", "mamba", "mamba", "mamba", "attention"],
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_engine(config: dict, workdir: Path, device: str, max_history: int, max_batched_tokens: int) -> LLMEngine:
    from transformers import AutoConfig, AutoModelForCausalLM

    config.setdefault("eos_token_id", 0)
    (workdir / "config.json").write_text(json.dumps(config))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(workdir), dtype=dtype).eval()
    weights = hf.state_dict()
    args = EngineArgs(
        model_path=str(workdir),
        device=device,
        max_running_requests=4,
        max_num_batched_tokens=max_batched_tokens,
        context_length=max_history + 4 * NEW_TOKENS,
        max_total_tokens=3 * (max_history + 4 * NEW_TOKENS),
    )
    engine = LLMEngine(args, weights=weights)
    del hf, weights
    return engine


def first_token_seconds(engine: LLMEngine, prompt: list[int], **kwargs) -> tuple[float, object]:
    """Time from adding the request to its first output token (the request generates one)."""
    sync(engine.device)
    started = time.perf_counter()
    engine.add_request(f"r{time.perf_counter_ns()}", prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), **kwargs)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                sync(engine.device)
                return time.perf_counter() - started, out
    raise RuntimeError("no output")


def measure(engine: LLMEngine, history_len: int, snapshot_root: Path) -> dict:
    vocab = engine.spec.vocab_size
    g = torch.Generator().manual_seed(history_len)
    history = torch.randint(1, vocab, (history_len,), generator=g).tolist()
    new = torch.randint(1, vocab, (NEW_TOKENS,), generator=g).tolist()

    prefill_s, first = first_token_seconds(engine, history, capture_state=True, retain_key="bench")
    state = first.state
    prompt = state.tokens + new
    active_s, _ = first_token_seconds(engine, prompt, initial_state=state, resume_key="bench")
    warm_s, warm_out = first_token_seconds(engine, prompt, initial_state=state)

    identity = ModelIdentity(engine.spec.architecture, engine.spec.config_sha256, "benchmark")
    started = time.perf_counter()
    path = save_snapshot(snapshot_root, state, SnapshotMeta(conversation_id="bench", turn=1), engine.spec, engine.state_dtypes, identity, "none")
    write_s = time.perf_counter() - started
    started = time.perf_counter()
    loaded, _ = load_snapshot(path, engine.spec, engine.state_dtypes, identity, "none")
    read_s = time.perf_counter() - started
    cold_ttft_s, _ = first_token_seconds(engine, prompt, initial_state=loaded)
    recompute_s, _ = first_token_seconds(engine, prompt)
    return {
        "history": history_len,
        "state_mib": state.nbytes / 2**20,
        "prefill_history_s": prefill_s,
        "recompute_s": recompute_s,
        "active_s": active_s,
        "warm_s": warm_s,
        "warm_copy_s": warm_out.restore_seconds,
        "cold_s": read_s + cold_ttft_s,
        "cold_read_s": read_s,
        "snapshot_write_s": write_s,
        "snapshot_mib": path.stat().st_size / 2**20,
    }


def model_arguments(doc: str, histories: list[int], max_batched_tokens: int) -> tuple[argparse.Namespace, dict]:
    """The command line of a benchmark over random weights from a config.json, and that config."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--scale", choices=["full", "cpu"], default="full")
    parser.add_argument("--histories", type=int, nargs="+", default=histories)
    parser.add_argument("--max-batched-tokens", type=int, default=max_batched_tokens, help="prefill chunk (the engine's --max-num-batched-tokens)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    config = json.loads(Path(args.config).read_text())
    if args.scale == "cpu":
        config.update(CPU_SCALE)
    return args, config


def main() -> None:
    args, config = model_arguments(__doc__, [1024, 4096, 16384], 2048)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "model").mkdir()
        engine = build_engine(config, workdir / "model", args.device, max(args.histories), args.max_batched_tokens)
        first_token_seconds(engine, [1, 2, 3])  # warm-up
        machine = (
            torch.cuda.get_device_name()
            if args.device == "cuda"
            else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
        )
        print(f"# {Path(args.config).name} ({args.scale}), {engine.dtype}, {machine}, prefill chunk {args.max_batched_tokens}")
        print(f"# continuation: {NEW_TOKENS} new tokens; times to the first new token, in ms")
        header = "| history | state MiB | recompute | active | warm (copy) | cold (read) | snapshot write | recompute / warm | recompute / cold |"
        print(header)
        print("|" + "---|" * (header.count("|") - 1))
        rows = []
        for n in args.histories:
            measure(engine, n, workdir / "snapshots")  # warm-up: kernels compiled and graphs captured for these shapes
            r = measure(engine, n, workdir / "snapshots")
            rows.append(r)
            ms = lambda x: f"{x * 1000:.1f}"  # noqa: E731
            print(
                f"| {n} | {r['state_mib']:.1f} | {ms(r['recompute_s'])} | {ms(r['active_s'])} | "
                f"{ms(r['warm_s'])} ({ms(r['warm_copy_s'])}) | {ms(r['cold_s'])} ({ms(r['cold_read_s'])}) | "
                f"{ms(r['snapshot_write_s'])} | {r['recompute_s'] / r['warm_s']:.1f}x | {r['recompute_s'] / r['cold_s']:.1f}x |",
                flush=True,
            )
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
