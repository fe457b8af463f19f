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

--cold-store: the COLD tier alone, without a model (random state of the config's shape, in the
dtypes a GPU engine uses: bf16 KV and conv state, float32 SSM state). The state is stored in the
chunk store (state store v2), then, with each file's page cache dropped before each read
(posix_fadvise DONTNEED after the fsync of its write; best effort, the kernel may keep pages):
the files' sequential read bandwidth (one thread, one file after another, in piece order); the
cold restore from disk into the engine's pools as the server does on CUDA (ChunkStore.load into
blocks of a host arena page-locked before the clock starts, state/host_arena.py, staged on the
device while it reads, then restore_state, until the device is done); the same into host memory
allocated for each load (pinned on CUDA: the path before the arena; in a fresh process every load
page-locks anew); the same staged from pageable host memory (DeviceStaging's pin_host off; CUDA
only); the same with the copy after the whole read (the path before staging; the server's on the
CPU); and the host-to-device copy alone (restore_state from the loaded host state). On the CPU
the two staged rows copy into CPU tensors instead (the tests' stand-in for a device): their
difference is the arena's alone. Each load's host state is dropped before the next, as a fresh
process would not have it. The ratio is the issue's figure: restore / (bytes / read bandwidth +
copy alone), at most 2 to pass.

    python benchmarks/restore_latency.py --cold-store --config tests/data/configs/granite-4.0-h-tiny.json \\
        --histories 4096 --tiny
    python benchmarks/restore_latency.py --cold-store --config tests/data/configs/granite-4.0-h-tiny.json \\
        --device cuda --histories 100000 --dir /path/on/the/store/disk --json benchmarks/results/h200-cold-restore.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engram.args import EngineArgs
from engram.engine.engine import LLMEngine
from engram.engine.pools import KVPool, StatePool, restore_state
from engram.engine.request import SamplingParams
from engram.models.spec import ModelSpec, parse_model_spec
from engram.state.chunks import DEFAULT_CHUNK_TOKENS, ChunkStore, PrefixHasher, StoredState
from engram.state.host_arena import HostArena
from engram.state.identity import ModelIdentity
from engram.state.sequence_state import SequenceState, StateDtypes, expected_tensors, is_kv_name
from engram.state.snapshot import SnapshotMeta, load_snapshot, save_snapshot
from engram.state.staging import DeviceStaging

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


def machine_label(device: str) -> str:
    cpu = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    return f"{torch.cuda.get_device_name()} ({cpu})" if device == "cuda" else cpu


def random_state(spec: ModelSpec, dtypes: StateDtypes, history: int) -> SequenceState:
    g = torch.Generator().manual_seed(history)
    tokens = torch.randint(1, spec.vocab_size, (history + 1,), generator=g).tolist()
    tensors = {name: torch.randn(shape, generator=g).to(dtype) for name, (shape, dtype) in expected_tensors(spec, dtypes, history).items()}
    return SequenceState(tokens, history, tensors)


def store_files(store: ChunkStore, stored: StoredState) -> list[Path]:
    return [store.piece_path(p.key) for p in stored.pieces] + [store.checkpoint_path(stored.checkpoint)]


def drop_page_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential_read_seconds(paths: list[Path]) -> float:
    """One thread reading the files whole, one after another (their page cache dropped first)."""
    drop_page_cache(paths)
    started = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            f.readinto(data)
    return time.perf_counter() - started


def cold_restore_seconds(
    store: ChunkStore,
    stored: StoredState,
    pools: tuple[StatePool, KVPool],
    device: torch.device,
    staged: bool,
    pin_host: bool = True,
    arena: HostArena | None = None,
) -> tuple[float, SequenceState]:
    """Disk to the pools: the load (staged on the device while it reads, into the arena, pinned or
    pageable host memory; or not staged) and the restore, until the device is done."""
    drop_page_cache(store_files(store, stored))
    state_pool, kv_pool = pools
    started = time.perf_counter()
    staging = DeviceStaging(device, pin_host, arena) if staged else None
    host = store.load(stored, staging=staging)
    source = staging.take() if staging is not None else None
    restore_state(state_pool, kv_pool, 0, list(range(kv_pool.num_blocks)), source or host)
    sync(device)
    return time.perf_counter() - started, host


def repeated(repeats: int, run: Callable[[], tuple[float, SequenceState]], keep: bool = False) -> tuple[list[float], SequenceState | None]:
    """`run`'s seconds, `repeats` times, and the last state. Each load's state is dropped before
    the next (its blocks back to the arena), unless `keep`: then every state is kept, so that
    torch's pinned allocator has no freed block to reuse, as in a fresh process."""
    seconds, kept, host = [], [], None
    for _ in range(repeats):
        host = None
        elapsed, host = run()
        seconds.append(elapsed)
        kept += [host] if keep else []
    return seconds, host


def copy_seconds(host: SequenceState, pools: tuple[StatePool, KVPool], device: torch.device) -> float:
    """The host-to-device copy alone: restore_state from a loaded host state."""
    state_pool, kv_pool = pools
    sync(device)
    started = time.perf_counter()
    restore_state(state_pool, kv_pool, 0, list(range(kv_pool.num_blocks)), host)
    sync(device)
    return time.perf_counter() - started


def measure_cold_store(spec: ModelSpec, dtypes: StateDtypes, device: torch.device, history: int, root: Path, repeats: int, chunk_tokens: int) -> dict:
    state = random_state(spec, dtypes, history)
    state_bytes = state.nbytes
    store = ChunkStore(root, spec, dtypes, PrefixHasher(b"restore_latency", chunk_tokens))
    started = time.perf_counter()
    stored = store.save(state)
    write_s = time.perf_counter() - started
    del state
    paths = store_files(store, stored)
    nbytes = sum(p.stat().st_size for p in paths)
    block = EngineArgs.kv_block_size
    pools = StatePool(spec, 1, dtypes, device), KVPool(spec, -(-history // block), block, dtypes.kv, device)
    cuda = device.type == "cuda"
    started = time.perf_counter()
    arena = HostArena(2 * state_bytes, pin=cuda)  # at start-up in the server: not on the clock; holds one state
    arena_s = time.perf_counter() - started
    read = [sequential_read_seconds(paths) for _ in range(repeats)]
    restore, _ = repeated(repeats, lambda: cold_restore_seconds(store, stored, pools, device, True, arena=arena))
    per_load, _ = repeated(repeats, lambda: cold_restore_seconds(store, stored, pools, device, True), keep=True)
    pageable, _ = repeated(repeats if cuda else 0, lambda: cold_restore_seconds(store, stored, pools, device, True, pin_host=False))
    unstaged, host = repeated(repeats, lambda: cold_restore_seconds(store, stored, pools, device, False))
    assert host is not None
    copy = [copy_seconds(host, pools, device) for _ in range(repeats)]
    read_s, restore_s, per_load_s, copy_s = statistics.median(read), statistics.median(restore), statistics.median(per_load), statistics.median(copy)
    bandwidth = nbytes / read_s
    bound_s = nbytes / bandwidth + copy_s
    return {
        "history": history,
        "files": len(paths),
        "bytes_on_disk": nbytes,
        "kv_bytes": sum(t.nbytes for name, t in host.flat_tensors().items() if is_kv_name(name)),
        "write_s": write_s,
        "arena_bytes": arena.capacity,
        "arena_setup_s": arena_s,
        "disk_read_bandwidth_bytes_per_s": bandwidth,
        "read_s": read_s,
        "restore_s": restore_s,
        "restore_staged_per_load_memory_s": per_load_s,
        "restore_read_then_copy_s": statistics.median(unstaged),
        "restore_staged_pageable_s": statistics.median(pageable) if pageable else None,
        "copy_to_device_s": copy_s,
        "bound_s": bound_s,
        "ratio": restore_s / bound_s,
        "ratio_per_load_memory": per_load_s / bound_s,
        "runs": {
            "read_s": read,
            "restore_s": restore,
            "restore_staged_per_load_memory_s": per_load,
            "restore_read_then_copy_s": unstaged,
            "restore_staged_pageable_s": pageable,
            "copy_to_device_s": copy,
        },
    }


def cold_store_main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold-store", action="store_true", required=True)
    parser.add_argument("--config", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--histories", type=int, nargs="+", default=[100_000])
    parser.add_argument("--tiny", action="store_true", help="the config shrunk to CPU_SCALE")
    parser.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS)
    parser.add_argument("--repeats", type=int, default=3, help="each figure is the median of this many runs")
    parser.add_argument("--dir", help="where the store is written (default: a temporary folder); the disk measured")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--label", default="", help="the machine and disk, in words, for the JSON file")
    args = parser.parse_args()
    config = json.loads(Path(args.config).read_text())
    if args.tiny:
        config.update(CPU_SCALE)
    spec = parse_model_spec(config)
    dtypes = StateDtypes(conv=torch.bfloat16, ssm=torch.float32, kv=torch.bfloat16)  # a GPU engine's defaults
    device = torch.device(args.device)
    machine = machine_label(args.device)
    print(f"# cold restore: {Path(args.config).name}{' (tiny)' if args.tiny else ''}, chunks of {args.chunk_tokens} tokens, {machine}")
    print(
        "| history | files | MB on disk | read MB/s | restore (arena) ms | memory per load ms | from pageable ms | read, then copy ms "
        "| copy alone ms | bound ms | ratio | ratio, memory per load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    ms = lambda x: "-" if x is None else f"{x * 1e3:.1f}"  # noqa: E731
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for n in args.histories:
            r = measure_cold_store(spec, dtypes, device, n, Path(tmp) / str(n), args.repeats, args.chunk_tokens)
            rows.append(r)
            print(
                f"| {n} | {r['files']} | {r['bytes_on_disk'] / 1e6:.1f} | {r['disk_read_bandwidth_bytes_per_s'] / 1e6:.0f} | "
                f"{ms(r['restore_s'])} | {ms(r['restore_staged_per_load_memory_s'])} | {ms(r['restore_staged_pageable_s'])} | "
                f"{ms(r['restore_read_then_copy_s'])} | {ms(r['copy_to_device_s'])} | {ms(r['bound_s'])} | {r['ratio']:.2f} | "
                f"{r['ratio_per_load_memory']:.2f} |",
                flush=True,
            )
            print(f"# arena: {r['arena_bytes'] / 2**30:g} GiB, set up in {r['arena_setup_s'] * 1e3:.0f} ms (the server's, at start-up)", flush=True)
    if args.json:
        report = {
            "machine": machine,
            "label": args.label,
            "device": args.device,
            "config": Path(args.config).name,
            "tiny": args.tiny,
            "dir": args.dir,
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(report, indent=2))


def main() -> None:
    if "--cold-store" in sys.argv[1:]:
        cold_store_main()
        return
    args, config = model_arguments(__doc__, [1024, 4096, 16384], 2048)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "model").mkdir()
        engine = build_engine(config, workdir / "model", args.device, max(args.histories), args.max_batched_tokens)
        first_token_seconds(engine, [1, 2, 3])  # warm-up
        machine = machine_label(args.device) if args.device != "cuda" else torch.cuda.get_device_name()
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
