"""What a turn's end costs to capture its state to host memory, whole or incremental.

For each history length: a first turn prefills the history (its state captured whole), then a
second turn of 16 new tokens adopts its slot and is captured twice over: with `host_base` (the
first turn's host copy; only the new tokens' KV and the recurrent state are copied) and without
(the whole history's KV copied again, as before incremental capture). Reported: the bytes each
capture copied device to host (`engram:capture_bytes`) and the time from adding the request to
its state being on the host.

    python benchmarks/capture_cost.py --config tests/data/configs/granite-4.0-h-tiny.json --scale cpu --histories 1024 4096
    python benchmarks/capture_cost.py --config tests/data/configs/granite-4.0-h-tiny.json --device cuda --histories 8192 32768 100000
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from restore_latency import NEW_TOKENS, build_engine, first_token_seconds, model_arguments, sync

from engram.engine.engine import LLMEngine


def captured(engine: LLMEngine, prompt: list[int], **kwargs) -> tuple[float, int, object]:
    """Seconds until the request's final state is on the host, the bytes its capture copied, the state."""
    before = engine.stats().capture_bytes_total
    started = time.perf_counter()
    _, out = first_token_seconds(engine, prompt, capture_state=True, **kwargs)
    state = out.state.wait()
    sync(engine.device)
    return time.perf_counter() - started, engine.stats().capture_bytes_total - before, state


def measure(engine: LLMEngine, history_len: int) -> dict:
    g = torch.Generator().manual_seed(history_len)
    history = torch.randint(1, engine.spec.vocab_size, (history_len,), generator=g).tolist()
    new = torch.randint(1, engine.spec.vocab_size, (NEW_TOKENS,), generator=g).tolist()
    first_s, first_bytes, first = captured(engine, history, retain_key="t1")
    prompt = first.tokens + new
    row = {"history": history_len, "first_turn_s": first_s, "first_turn_bytes": first_bytes}
    for mode, host_base in (("whole", None), ("incremental", first)):
        engine.release_retained("t2")
        s, nbytes, _ = captured(engine, prompt, resume_key="t1", host_base=host_base, retain_key="t2")
        engine.release_retained("t2")
        first_s, _, first = captured(engine, history, retain_key="t1")  # the slot again, for the next mode
        prompt = first.tokens + new
        row |= {f"{mode}_s": s, f"{mode}_bytes": nbytes}
    return row


def main() -> None:
    args, config = model_arguments(__doc__, [1024, 4096], 8192)
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(config, Path(tmp), args.device, max(args.histories), args.max_batched_tokens)
        first_token_seconds(engine, [1, 2, 3])  # warm-up
        print(f"# {Path(args.config).name} ({args.scale}), {engine.dtype}, {args.device}; second turn: {NEW_TOKENS} new tokens")
        print("| history | turn-1 capture MB | turn-2 whole MB | turn-2 incremental MB | whole ms | incremental ms |")
        print("|---|---|---|---|---|---|")
        rows = []
        for n in args.histories:
            measure(engine, n)  # warm-up of these shapes
            r = measure(engine, n)
            rows.append(r)
            print(
                f"| {n} | {r['first_turn_bytes'] / 1e6:.1f} | {r['whole_bytes'] / 1e6:.1f} | {r['incremental_bytes'] / 1e6:.3f} | "
                f"{r['whole_s'] * 1000:.1f} | {r['incremental_s'] * 1000:.1f} |",
                flush=True,
            )
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
