"""`engram bench`: offline throughput of the engine on a checkpoint (random prompts, no server).

Prints the time to prefill a batch of prompts and the decode rate that follows, with the engine
arguments `engram serve` takes. For side-by-side comparisons with transformers and the GPU
roofline, see `benchmarks/`.
"""

from __future__ import annotations

import argparse
import time

import torch

from engram.args import EngineArgs, add_dataclass_args, from_namespace


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, EngineArgs)
    parser.add_argument("--batch", type=int, default=8, help="prompts run together")
    parser.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt")


def run(ns: argparse.Namespace) -> None:
    from engram.engine.engine import LLMEngine
    from engram.engine.request import SamplingParams

    args = from_namespace(EngineArgs, ns)
    from engram.models.builtin import resolve_model

    args.model_path = resolve_model(args.model_path).path
    engine = LLMEngine(args)
    vocab = engine.spec.vocab_size
    params = SamplingParams(max_tokens=ns.output_len, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)

    def sync() -> None:
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)

    def run_batch(tag: str) -> tuple[float, float]:
        for i in range(ns.batch):
            engine.add_request(f"{tag}-{i}", torch.randint(0, vocab, (ns.prompt_len,), generator=generator).tolist(), params)
        sync()
        started = time.perf_counter()
        first_done = None
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if first_done is None and len([o for o in outputs if o.token_ids]) == ns.batch:
                sync()
                first_done = time.perf_counter()
        sync()
        return (first_done or time.perf_counter()) - started, time.perf_counter() - started

    run_batch("warmup")
    prefill_s, total_s = run_batch("bench")
    decode_s = max(total_s - prefill_s, 1e-9)
    print(f"model {engine.model_path} ({engine.spec.architecture}), {engine.dtype}, {engine.device}")
    print(f"batch {ns.batch} x {ns.prompt_len} prompt tokens: prefill {prefill_s * 1000:.1f} ms ({ns.batch * ns.prompt_len / prefill_s:,.0f} tok/s)")
    print(
        f"decode {ns.output_len - 1} steps: {decode_s * 1000:.1f} ms "
        f"({ns.batch * (ns.output_len - 1) / decode_s:,.0f} tok/s, {decode_s / max(ns.output_len - 1, 1) * 1000:.2f} ms/step)"
    )
