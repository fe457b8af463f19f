"""The cost of structured outputs' token mask at decode, in-process, one run.

    python benchmarks/bench_grammar.py --config granite-4.0-h-tiny [--out results.json]

One engine on random weights (as bench_speed.py builds them) with a byte-level tokenizer padded to
the model's vocabulary. With B sequences decoding, the mean step time when none is constrained vs
when every one follows a JSON schema (nested object, enum, pattern, array; xgrammar fills each
row's bitmask on the host and applies it to the logits on the device, engine/grammar.py). Both
runs are greedy on the same prompts; a random model inside a free string rarely closes it, so no
sequence ends in the timed steps (checked). Seeded sampling would time the per-request generators
(one host-driven draw per row) rather than the mask; they are timed apart, as `seeded_step_ms`
(temperature 1, a seed per request, no grammar), the other path off the decode graph's sampler.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_speed as bs  # noqa: E402  (config lookup, random weights, logging)
from bench_spec import mean_step_seconds  # noqa: E402

from engram.args import EngineArgs  # noqa: E402
from engram.engine import engine as engine_mod  # noqa: E402
from engram.engine.request import SamplingParams, StructuredOutputsParams  # noqa: E402
from engram.models.byte_tokenizer import build_byte_tokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "kind": {"enum": ["note", "task", "event"]},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "meta": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}}, "required": ["tags"]},
        "body": {"type": "string"},
    },
    "required": ["id", "kind", "code", "meta", "body"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="granite-4.0-h-tiny")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]

    cfg = json.loads(bs.find_config(args.config).read_text())
    tokenizer = build_byte_tokenizer(cfg["vocab_size"])
    workdir = Path(tempfile.mkdtemp())
    tokenizer.save_pretrained(str(workdir))
    bs.random_weights_model({**cfg, "eos_token_id": tokenizer.eos_token_id}, workdir)
    eng = engine_mod.LLMEngine(
        EngineArgs(
            model_path=str(workdir),
            dtype="bfloat16",
            device="cuda",
            max_running_requests=max(args.batches),
            max_total_tokens=65536,
            context_length=args.prompt_len + 8 * args.steps + 64,
        )
    )
    free = SamplingParams(max_tokens=8 * args.steps, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=8 * args.steps, temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    results: dict = {"config": args.config, "schema": SCHEMA, "steps": args.steps, "prompt_len": args.prompt_len}
    for b in args.batches:
        mean_step_seconds(eng, b, 4, args.prompt_len, constrained)  # the grammar compiled, the mask kernel built
        plain = mean_step_seconds(eng, b, args.steps, args.prompt_len, free)
        masked = mean_step_seconds(eng, b, args.steps, args.prompt_len, constrained)
        seeded = mean_step_seconds(eng, b, args.steps, args.prompt_len, dataclasses.replace(free, temperature=1.0, seed=1))
        row = {
            "plain_step_ms": plain * 1e3,
            "json_schema_step_ms": masked * 1e3,
            "mask_cost": masked / plain - 1,
            "plain_tok_s": b / plain,
            "json_schema_tok_s": b / masked,
            "seeded_step_ms": seeded * 1e3,
        }
        results[f"batch_{b}"] = row
        bs.log(f"batch {b}: {json.dumps({k: round(v, 4) for k, v in row.items()})}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
