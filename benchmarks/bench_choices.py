"""OpenAI `n` choices of one long prompt: each choice prefilling the prompt vs one shared prefill.

Serves a model over HTTP in this process and times `/v1/completions` with `n` greedy choices, once
with the shared prefill off (every choice computes the whole prompt) and once on (the state one
token short of the prompt is computed once and restored into every choice). Prints the median
time of each and whether the choices' texts agree.

    python benchmarks/bench_choices.py [--model-path DIR] [--prompt-len 800] [--n 4] [--repeats 3]

Without --model-path it serves the embedded default model.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from engram.args import EngineArgs, ServerArgs
from engram.launch_server import build_app
from engram.models.embedded import ensure_embedded_model
from engram.server import serving
from engram.server.background import BackgroundServer

MODEL = "bench"


def timed_request(url: str, body: dict) -> tuple[float, list[str]]:
    start = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - start, [c["text"] for c in r.json()["choices"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--prompt-len", type=int, default=800, help="prompt length in characters")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model_path = args.model_path or str(ensure_embedded_model())
    engine_args = EngineArgs(model_path=model_path, max_running_requests=max(args.n, 4), context_length=args.prompt_len + 256)
    body = {
        "model": MODEL,
        "prompt": ("ab" * args.prompt_len)[: args.prompt_len],
        "n": args.n,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    shared_min = serving.SHARED_PREFILL_MIN_TOKENS
    results = {}
    with BackgroundServer(build_app(engine_args, ServerArgs(served_model_name=MODEL))) as srv:
        for label, threshold in (("each choice prefills", 1 << 40), ("one shared prefill", shared_min)):
            serving.SHARED_PREFILL_MIN_TOKENS = threshold
            timed_request(srv.url, body)  # warm-up
            runs = [timed_request(srv.url, body) for _ in range(args.repeats)]
            results[label] = (statistics.median(t for t, _ in runs), runs[-1][1])
    serving.SHARED_PREFILL_MIN_TOKENS = shared_min
    (t_each, texts_each), (t_shared, texts_shared) = results.values()
    print(f"model {model_path}; prompt {args.prompt_len} chars; n={args.n}; {args.max_tokens} tokens per choice; median of {args.repeats}")
    print("| prefill | request time | ratio |\n| --- | --- | --- |")
    print(f"| each choice | {t_each * 1e3:.1f} ms | 1.00x |")
    print(f"| shared | {t_shared * 1e3:.1f} ms | {t_each / t_shared:.2f}x |")
    print(f"same texts: {texts_each == texts_shared}")


if __name__ == "__main__":
    main()
