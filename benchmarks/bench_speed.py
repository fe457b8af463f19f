"""Engram vs transformers on one GPU, same random weights, one run.

    python benchmarks/bench_speed.py --config granite-4.0-h-tiny [--out results.json]

Builds the model from a config (shapes only, random bf16 weights) once with `transformers`, hands
the same tensors to the engine, and measures side by side:
  - decode tokens/s at batch 1, 8, 64 (engine: end-to-end engine steps, CUDA graphs; transformers:
    `generate`, decode time = time(prefill + n tokens) - time(prefill + 1 token));
  - prefill tokens/s at 2K and 8K tokens (one request, time to its first token);
  - time to first token of a resumed turn (64 new tokens on top of a captured state of H history
    tokens, restored from GPU memory and from pinned host memory) vs a full prefill of H + 64;
  - the memory-bandwidth roofline of a decode step (bytes read per step: active weights + state
    + KV, over the measured device copy bandwidth) and the fraction of it reached.
Configs are looked up in ../shared/configs, then tests/data/configs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from engram.args import EngineArgs  # noqa: E402
from engram.engine import engine as engine_mod  # noqa: E402
from engram.engine.request import SamplingParams  # noqa: E402
from engram.models.loader import load_model_from_state_dict  # noqa: E402

RESULTS: dict = {}
OUT_PATH: Path | None = None


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save() -> None:
    if OUT_PATH is not None:
        OUT_PATH.write_text(json.dumps(RESULTS, indent=2, default=str))


def find_config(name: str) -> Path:
    p = Path(name)
    if p.is_file():
        return p
    for folder in (ROOT.parent / "shared" / "configs", ROOT / "shared" / "configs", ROOT / "tests" / "data" / "configs"):
        for cand in (folder / name, folder / f"{name}.json"):
            if cand.is_file():
                return cand
    raise FileNotFoundError(f"no config {name!r} in ../shared/configs or tests/data/configs")


def sync() -> None:
    torch.cuda.synchronize()


def replay_seconds(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Seconds per replay of a captured CUDA graph, after three warm-up replays."""
    for _ in range(3):
        graph.replay()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        graph.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / 1e3 / reps


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, bytes read + bytes written per second (median of 10)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / sorted(times)[len(times) // 2]


# ---- models ---------------------------------------------------------------------------------------


def random_weights_model(cfg: dict, workdir: Path):
    """The transformers model of `cfg` with random bfloat16 weights on the GPU, its config written to
    `workdir`; engines built afterwards take its weights (no checkpoint written or read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {"eos_token_id": 0, **cfg}
    (workdir / "config.json").write_text(json.dumps(cfg))
    hf_cfg = AutoConfig.from_pretrained(workdir)
    t = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()
    sync()
    log(
        f"transformers model built on the GPU with random weights in {time.perf_counter() - t:.1f}s "
        f"({sum(p.numel() for p in hf.parameters()) / 1e9:.2f}B parameters)"
    )
    state = hf.state_dict()

    def load_shared(spec, path, dtype, device):
        return load_model_from_state_dict(spec, state, dtype, device)

    engine_mod.load_model = load_shared
    return hf


def build_models(config_path: Path, workdir: Path, args):
    hf = random_weights_model(json.loads(config_path.read_text()), workdir)
    eargs = EngineArgs(
        model_path=str(workdir),
        dtype="bfloat16",
        device="cuda",
        max_running_requests=max(*args.decode_batches, 2),  # room for a retained (ACTIVE) slot beside a running one
        max_num_batched_tokens=args.max_batched_tokens,
        max_total_tokens=args.max_total_tokens,
        context_length=max(args.resume_histories + [max(args.prefill_lens), args.prompt_len + args.decode_steps]) + args.new_tokens + 64,
        enable_fast_ops=not args.reference_ops,
        enable_cuda_graph=not args.no_cuda_graph,
        enable_overlap_schedule=not args.no_overlap_schedule,
        mamba_ssm_dtype=args.mamba_ssm_dtype,
    )
    t = time.perf_counter()
    eng = engine_mod.LLMEngine(eargs)
    sync()
    log(f"engine built in {time.perf_counter() - t:.1f}s; kernels: {engine_mod.select_kernels('cuda', eargs.enable_fast_ops).name}")
    if args.no_hf:
        del hf
        hf = None
        torch.cuda.empty_cache()
    return hf, eng


PROMPT_SEED = 0  # added to every prompt's seed (--prompt-seed): another set of random prompts


def rand_tokens(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed + PROMPT_SEED)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def greedy(n: int | None) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run_all(eng) -> dict:
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


_uid = [0]


def uid(prefix: str) -> str:
    _uid[0] += 1
    return f"{prefix}{_uid[0]}"


# ---- engine measurements ----------------------------------------------------------------------------


def engine_decode(eng, batch: int, prompt_len: int, steps: int, vocab: int) -> dict:
    """`steps` timed decode steps of `batch` sequences that all decode in each of them. With long
    prompts the sequences finish their prefills steps apart, the first ones decoding meanwhile, so
    they run without a token limit (none finishes inside the window) and are aborted after it."""
    ids = [uid("w") for _ in range(batch)]
    for i, r in enumerate(ids):  # warm-up: compiles, captures this batch's CUDA graph
        eng.add_request(r, rand_tokens(prompt_len, vocab, 1000 + i), greedy(4))
    run_all(eng)
    ids = [uid("d") for _ in range(batch)]
    for i, r in enumerate(ids):
        eng.add_request(r, rand_tokens(prompt_len, vocab, 2000 + i), greedy(None))
    first = {}
    while len(first) < batch:  # prefill until every sequence has its first token
        for out in eng.step():
            first[out.request_id] = True
    sync()
    replays0, preempted0 = eng.runner.num_graph_replays, eng.scheduler.num_preemptions
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync()
    dt = time.perf_counter() - t
    res = {
        "batch": batch,
        "steps": steps,
        "seconds": dt,
        "tok_s": batch * steps / dt,
        "graph_replays": eng.runner.num_graph_replays - replays0,
        "preemptions": eng.scheduler.num_preemptions - preempted0,
    }
    # GPU time of one step alone: replay the captured graph (its buffers still hold the last step)
    graphs = getattr(eng.runner, "_graphs", {})
    bucket = eng.runner.decode_bucket(batch) if hasattr(eng.runner, "decode_bucket") else None
    if bucket in graphs:
        res["gpu_step_ms"] = replay_seconds(graphs[bucket][0], 20) * 1e3
        res["gpu_tok_s"] = batch / (res["gpu_step_ms"] / 1e3)
    for r in ids:
        eng.abort_request(r)
    run_all(eng)
    return res


def engine_ttft(eng, prompt: list[int], **kw) -> tuple[float, float, object]:
    """(seconds from add_request to the first token, of which in add_request, output)."""
    sync()
    r = uid("t")
    t = time.perf_counter()
    eng.add_request(r, prompt, greedy(1), **kw)
    t_add = time.perf_counter() - t
    out = None
    while out is None:
        for o in eng.step():
            if o.request_id == r and o.finished:
                out = o
    sync()
    return time.perf_counter() - t, t_add, out


def engine_prefill(eng, length: int, vocab: int) -> dict:
    prompt = rand_tokens(length, vocab, 3000 + length)
    engine_ttft(eng, prompt)  # warm-up at this length (kernel autotuning)
    ttft, _, _ = engine_ttft(eng, rand_tokens(length, vocab, 4000 + length))
    return {"tokens": length, "seconds": ttft, "tok_s": length / ttft}


def engine_resume(eng, history: int, new: int, vocab: int) -> dict:
    hist = rand_tokens(history, vocab, 5000 + history)
    new_tokens = rand_tokens(new, vocab, 6000 + history)
    full_s, _, full_out = engine_ttft(eng, hist + new_tokens)
    key = uid("conv")
    _, _, snap = engine_ttft(eng, hist, capture_state=True, retain_key=key)
    state = snap.state.wait()  # its device-to-host copy may still be in flight
    assert state is not None and state.state_len == history
    res = {"history": history, "new_tokens": new, "full_prefill_s": full_s}
    # state in GPU memory (the ACTIVE tier keeps it there)
    gpu_state = type(state)(state.tokens, state.state_len, {k: v.to("cuda") for k, v in state.tensors.items()})
    engine_ttft(eng, hist + new_tokens, initial_state=gpu_state)  # warm-up (shapes of the resumed chunk)
    s, s_add, out = engine_ttft(eng, hist + new_tokens, initial_state=gpu_state)
    res.update(resumed_gpu_s=s, resumed_gpu_validation_s=s_add, same_first_token_gpu=out.token_ids == full_out.token_ids)
    del gpu_state
    # state in pinned host memory (the WARM tier)
    host_state = type(state)(state.tokens, state.state_len, {k: v.pin_memory() for k, v in state.tensors.items()})
    s, s_add, out = engine_ttft(eng, hist + new_tokens, initial_state=host_state)
    res.update(resumed_host_s=s, resumed_host_validation_s=s_add, same_first_token_host=out.token_ids == full_out.token_ids)
    # the ACTIVE tier: the slot and KV pages kept on the GPU are adopted, nothing copied
    s, s_add, out = engine_ttft(eng, hist + new_tokens, resume_key=key)
    res.update(resumed_active_s=s, same_first_token_active=out.token_ids == full_out.token_ids, resumed_active_cached_tokens=out.num_cached_tokens)
    res["speedup_active"] = full_s / s
    res["state_bytes"] = sum(v.numel() * v.element_size() for v in state.tensors.values())
    res["speedup_gpu"] = full_s / res["resumed_gpu_s"]
    res["speedup_host"] = full_s / res["resumed_host_s"]
    del host_state, state, snap
    torch.cuda.empty_cache()
    return res


def engine_profile(eng, vocab: int, batches: list[int], prompt_len: int) -> None:
    """Where the time goes: host (cProfile) and device kernels (torch.profiler) of a 2K prefill,
    one eager decode forward per batch size, and the host side of decode steps at the largest."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    def kernels_table(prof, rows=25):
        return prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=70)

    prompt = rand_tokens(2048, vocab, 77)
    engine_ttft(eng, prompt)
    pr = cProfile.Profile()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        pr.enable()
        ttft, _, _ = engine_ttft(eng, rand_tokens(2048, vocab, 78))
        pr.disable()
    log(f"PROFILE prefill 2048: ttft {ttft * 1e3:.1f} ms")
    print(kernels_table(prof), flush=True)
    pstats.Stats(pr).sort_stats("cumulative").print_stats(30)
    for b in batches:
        bucket = eng.runner.decode_bucket(b)
        if bucket not in eng.runner._graphs:
            continue
        batch = eng.runner._graph_batch(bucket)
        with torch.inference_mode():
            eng.runner.model(batch)
            sync()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                eng.runner.model(batch)
                sync()
        log(f"PROFILE eager decode forward, batch {bucket}")
        print(kernels_table(prof, 30), flush=True)
        log(f"PROFILE graph replay, batch {bucket}: each kernel's share of the step")
        print(replay_critical_path(eng.runner._graphs[bucket][0]), flush=True)
    for b in batches:
        if eng.runner.decode_bucket(b) not in eng.runner._graphs:
            continue
        log(f"PROFILE engine decode steps, batch {b}: the GPU's timeline around the graph replays")
        print(engine_step_timeline(eng, b, vocab, prompt_len), flush=True)
    b = max(batches)
    _start_decoding(eng, b, vocab, prompt_len)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(16):
        eng.step()
    pr.disable()
    run_all(eng)
    log(f"PROFILE host, 16 decode steps at batch {b}")
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)


def _start_decoding(eng, batch: int, vocab: int, prompt_len: int, max_tokens: int = 40) -> None:
    """Add `batch` greedy requests and step until each has its first token (past the prefills)."""
    started = set()
    for i in range(batch):
        eng.add_request(uid("p"), rand_tokens(prompt_len, vocab, 7000 + i), greedy(max_tokens))
    while len(started) < batch:
        started.update(out.request_id for out in eng.step())


def _device_events(prof) -> list[tuple[float, float, str]]:
    """(start, end, name) in microseconds of the kernels, copies and memsets of a profile, in order."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    return sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"][:60])
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )


def engine_step_timeline(eng, batch: int, vocab: int, prompt_len: int, steps: int = 16) -> str:
    """`steps` engine decode steps under the profiler: per step, the wall time, the time the GPU
    was busy (union of kernels and copies), and what ran besides the captured graph (per name: the
    count beyond the graph's own, and its total time)."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    _start_decoding(eng, batch, vocab, prompt_len)
    for _ in range(4):
        eng.step()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        sync()
        wall = time.perf_counter() - t
    run_all(eng)
    events = _device_events(prof)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.runner._graphs[eng.runner.decode_bucket(batch)][0].replay()
        sync()
    in_graph = Counter(name for _, _, name in _device_events(prof))
    busy, end = 0.0, events[0][0] if events else 0.0
    count, took = Counter(), Counter()
    for start, stop, name in events:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
        count[name] += 1
        took[name] += stop - start
    span = (events[-1][1] - events[0][0]) if events else 0.0
    rows = [
        f"wall {wall / steps * 1e6:.1f} us/step; GPU timeline {span / steps:.1f} us/step, busy {busy / steps:.1f}, idle {(span - busy) / steps:.1f}",
        f"{'besides the graph':60s} {'per step':>8s} {'us/step':>8s}",
    ]
    for name in sorted(count, key=lambda n: -took[n]):
        extra = count[name] / steps - in_graph[name]
        if extra > 0.05:
            rows.append(f"{name:60s} {extra:8.1f} {took[name] / count[name] * extra:8.1f}")
    return "\n".join(rows)


def replay_critical_path(graph: torch.cuda.CUDAGraph, reps: int = 5) -> str:
    """Per kernel name, the time by which it moves the end of the step: its end minus the latest end
    of the kernels that started before it (0 when it ends inside one), averaged over `reps` replays.
    Kernels overlap under programmatic dependent launch, so the eager profile's durations overstate
    the small ones; these shares add up to the step's GPU time."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        graph.replay()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        sync()
    kernels = _device_events(prof)
    share: dict[str, list[float]] = {}
    end = kernels[0][0] if kernels else 0.0
    for start, stop, name in kernels:
        s = share.setdefault(name, [0, 0.0])
        s[0] += 1
        s[1] += max(0.0, stop - end)  # an idle gap before it counts as its own
        end = max(end, stop)
    total = sum(v[1] for v in share.values())
    rows = [f"{'kernel':60s} {'per step':>8s} {'us/step':>8s} {'%':>6s}"]
    for name, (n, t) in sorted(share.items(), key=lambda kv: -kv[1][1]):
        rows.append(f"{name:60s} {n / reps:8.1f} {t / reps:8.1f} {100 * t / max(total, 1e-9):6.1f}")
    rows.append(f"{'step':60s} {len(kernels) / reps:8.1f} {total / reps:8.1f}")
    return "\n".join(rows)


# ---- transformers measurements ------------------------------------------------------------------------


def hf_generate_time(hf, ids: torch.Tensor, new: int) -> float:
    sync()
    t = time.perf_counter()
    with torch.inference_mode():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    sync()
    return time.perf_counter() - t


def hf_decode(hf, batch: int, prompt_len: int, steps: int, vocab: int) -> dict:
    ids = torch.randint(1, vocab, (batch, prompt_len), device="cuda")
    hf_generate_time(hf, ids, 2)  # warm-up
    t1 = hf_generate_time(hf, ids, 1)
    tn = hf_generate_time(hf, ids, 1 + steps)
    return {"batch": batch, "steps": steps, "seconds": tn - t1, "tok_s": batch * steps / (tn - t1)}


def hf_prefill(hf, length: int, vocab: int) -> dict:
    ids = torch.randint(1, vocab, (1, length), device="cuda")
    with torch.inference_mode():
        hf(ids[:, :256], logits_to_keep=1, use_cache=False)  # warm-up
        sync()
        t = time.perf_counter()
        hf(ids, logits_to_keep=1, use_cache=False)
        sync()
    dt = time.perf_counter() - t
    return {"tokens": length, "seconds": dt, "tok_s": length / dt}


# ---- roofline -------------------------------------------------------------------------------------------


def decode_bytes_per_step(model, spec, state_pool, kv_pool, batch: int, context: int) -> dict:
    """Bytes a decode step must read (and state it must write) at `batch` sequences of `context` tokens."""
    expert_params, other, embed = 0, 0, 0
    moe_layers = []
    stacks = ("moe.input_linear", "moe.output_linear", "mixer.up_proj", "mixer.down_proj", "experts.gate_up_proj", "experts.down_proj")
    for name, p in model.named_parameters():  # tied weights appear once
        b = p.numel() * p.element_size()
        if name.endswith(stacks) and p.dim() == 3:  # experts' stacked weights
            expert_params += b
            moe_layers.append(p.shape[0])
        elif name == "embed_tokens.weight" and not spec.tie_word_embeddings:
            embed += batch * p.shape[1] * p.element_size()  # only the batch's rows
        else:
            other += b
    cfg = spec.config
    top_k = int(cfg.get("num_experts_per_tok", 0) or 0)
    experts = moe_layers[0] if moe_layers else 0
    active_frac = (1 - (1 - top_k / experts) ** batch) if experts else 0.0  # distinct experts hit, uniform routing
    expert_bytes = expert_params * active_frac
    state = 0
    for t in state_pool.tensors.values():
        state += t[0].numel() * t.element_size()
    state_rw = 2 * state * batch  # read and written back
    kv = 0
    for i in kv_pool.k:
        per_tok = kv_pool.k[i][0].numel() * kv_pool.k[i].element_size() * 2
        kv += per_tok * (context + 1) * batch
    total = other + embed + expert_bytes + state_rw + kv
    return {
        "weights": other + embed,
        "experts_active": expert_bytes,
        "state_rw": state_rw,
        "kv": kv,
        "total": total,
        "active_expert_fraction": active_frac,
    }


# ---- main -------------------------------------------------------------------------------------------------


def main() -> None:
    global OUT_PATH, PROMPT_SEED
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="granite-4.0-h-tiny")
    ap.add_argument("--decode-batches", default="1,8,64")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence in the decode runs")
    ap.add_argument("--prefill-lens", default="2048,8192")
    ap.add_argument("--resume-histories", default="2048,32768,131072")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hf-decode-batches", default="1,8,64")
    ap.add_argument("--hf-decode-steps", type=int, default=8)
    ap.add_argument("--hf-prefill-lens", default="2048,8192")
    ap.add_argument("--max-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-total-tokens", type=int, default=None)
    ap.add_argument("--no-hf", action="store_true", help="engine only")
    ap.add_argument("--reference-ops", action="store_true", help="engine with the torch reference ops")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--no-overlap-schedule", action="store_true", help="engine steps one at a time (tokens read back before the next launch)")
    ap.add_argument("--mamba-ssm-dtype", default=EngineArgs.mamba_ssm_dtype, help="dtype of the engine's SSM state (the engine's flag)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--profile", action="store_true", help="print where the engine's time goes (after the decode runs)")
    ap.add_argument(
        "--prompt-seed", type=int, default=0, help="shift the random prompts' seeds (the routing, and so a decode step's time, depends on the tokens)"
    )
    args = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    args.decode_batches = ints(args.decode_batches)
    args.prefill_lens = ints(args.prefill_lens)
    args.resume_histories = ints(args.resume_histories)
    args.hf_decode_batches = ints(args.hf_decode_batches)
    args.hf_prefill_lens = ints(args.hf_prefill_lens)
    longest = max(args.resume_histories + args.prefill_lens) + args.new_tokens
    if args.max_total_tokens is None:
        # room for a retained (ACTIVE) history next to a running one of the same length
        args.max_total_tokens = 2 * longest + max(args.decode_batches) * (args.prompt_len + args.decode_steps + 8) + 4096
    OUT_PATH = Path(args.out) if args.out else None
    PROMPT_SEED = args.prompt_seed

    config_path = find_config(args.config)
    props = torch.cuda.get_device_properties(0)
    import transformers

    RESULTS["machine"] = {
        "gpu": props.name,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
    }
    try:
        import triton

        RESULTS["machine"]["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import fla

        RESULTS["machine"]["fla_core"] = getattr(fla, "__version__", "?")
    except ImportError:
        RESULTS["machine"]["fla_core"] = None
    RESULTS["config"] = str(config_path.name)
    RESULTS["command"] = " ".join(sys.argv)
    bw = copy_bandwidth()
    RESULTS["copy_bandwidth_GBps"] = bw / 1e9
    log(f"{props.name}: device copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    save()

    with tempfile.TemporaryDirectory() as tmp:
        hf, eng = build_models(config_path, Path(tmp), args)
        spec = eng.spec
        vocab = spec.vocab_size
        RESULTS["kernels"] = engine_mod.select_kernels("cuda", not args.reference_ops).name
        RESULTS["params_B"] = sum(p.numel() for p in eng.model.parameters()) / 1e9

        def phase(name: str, fn, results: dict, key: str) -> None:
            """Run one measurement and save its result (or its error) under `key` at once."""
            t = time.perf_counter()
            try:
                r = fn()
                log(f"{name}: {json.dumps(r, default=lambda x: round(x, 4) if isinstance(x, float) else str(x))} ({time.perf_counter() - t:.1f}s)")
            except Exception as e:  # noqa: BLE001 - report and go on with the other phases
                import traceback

                traceback.print_exc()
                log(f"{name}: FAILED {type(e).__name__}: {e}")
                r = {"error": f"{type(e).__name__}: {e}"}
            results[key] = r
            save()

        def decode_with_roofline(b: int) -> dict:
            r = engine_decode(eng, b, args.prompt_len, args.decode_steps, vocab)
            rb = decode_bytes_per_step(eng.model, spec, eng.state_pool, eng.kv_pool, b, args.prompt_len + args.decode_steps // 2)
            roof = b / (rb["total"] / bw)
            r.update(roofline_bytes=rb, roofline_tok_s=roof, roofline_fraction=r["tok_s"] / roof)
            if "gpu_tok_s" in r:
                r["roofline_fraction_gpu"] = r["gpu_tok_s"] / roof
            return r

        R = RESULTS.setdefault("engine", {})
        for b in args.decode_batches:
            phase(f"engine decode bs{b}", lambda b=b: decode_with_roofline(b), R, f"decode_bs{b}")
        if args.profile:
            phase("engine profile", lambda: engine_profile(eng, vocab, args.decode_batches, args.prompt_len) or {}, R, "profile")
        for n in args.prefill_lens:
            phase(f"engine prefill {n}", lambda n=n: engine_prefill(eng, n, vocab), R, f"prefill_{n}")
        for h in args.resume_histories:
            phase(f"engine resume {h}", lambda h=h: engine_resume(eng, h, args.new_tokens, vocab), R, f"resume_{h}")
        eng = None  # the engine's GPU memory goes back before the transformers runs
        torch.cuda.empty_cache()

        if hf is not None:
            H = RESULTS.setdefault("transformers", {})
            for n in args.hf_prefill_lens:
                phase(f"transformers prefill {n}", lambda n=n: hf_prefill(hf, n, vocab), H, f"prefill_{n}")
            for b in args.hf_decode_batches:
                phase(f"transformers decode bs{b}", lambda b=b: hf_decode(hf, b, args.prompt_len, args.hf_decode_steps, vocab), H, f"decode_bs{b}")
    print_table()


def print_table() -> None:
    E, H = RESULTS.get("engine", {}), RESULTS.get("transformers", {})

    def f(d, key, fmt="{:,.0f}"):
        v = d.get(key)
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    print()
    print(
        f"machine: {RESULTS['machine']}; copy bandwidth {RESULTS['copy_bandwidth_GBps']:,.0f} GB/s; config {RESULTS['config']}; kernels {RESULTS.get('kernels')}"
    )
    print(f"command: {RESULTS['command']}")
    print("| measure | engram | transformers | ratio |")
    print("| --- | --- | --- | --- |")
    for key in sorted({k for k in E if k.startswith("decode")} | {k for k in H if k.startswith("decode")}, key=lambda k: int(k[9:])):
        e, h = E.get(key, {}), H.get(key, {})
        ratio = f"{e['tok_s'] / h['tok_s']:.1f}x" if "tok_s" in e and "tok_s" in h else "-"
        print(f"| decode tok/s, batch {key[9:]} | {f(e, 'tok_s')} | {f(h, 'tok_s')} | {ratio} |")
    for key in sorted({k for k in E if k.startswith("prefill")} | {k for k in H if k.startswith("prefill")}, key=lambda k: int(k[8:])):
        e, h = E.get(key, {}), H.get(key, {})
        ratio = f"{e['tok_s'] / h['tok_s']:.1f}x" if "tok_s" in e and "tok_s" in h else "-"
        print(f"| prefill tok/s, {key[8:]} tokens | {f(e, 'tok_s')} | {f(h, 'tok_s')} | {ratio} |")
    print()
    print("| decode batch | engine tok/s | GPU-only tok/s (graph replay) | roofline tok/s | fraction (engine) | fraction (GPU) | bytes/step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for key in sorted((k for k in E if k.startswith("decode")), key=lambda k: int(k[9:])):
        e = E[key]
        if "roofline_tok_s" in e:
            print(
                f"| {key[9:]} | {e['tok_s']:,.0f} | {f(e, 'gpu_tok_s')} | {e['roofline_tok_s']:,.0f} | {e['roofline_fraction']:.1%} | "
                f"{f(e, 'roofline_fraction_gpu', '{:.1%}')} | {e['roofline_bytes']['total'] / 1e9:.2f} GB |"
            )
    print()
    print(
        "| history tokens | full prefill TTFT | resumed TTFT, ACTIVE slot adopted | ratio | resumed TTFT, state restored from GPU memory | ratio "
        "| resumed TTFT, state restored from pinned host memory | ratio | same first token |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for key in sorted((k for k in E if k.startswith("resume")), key=lambda k: int(k[7:])):
        e = E[key]
        if "full_prefill_s" in e:
            same = all(e[k] for k in ("same_first_token_gpu", "same_first_token_host", "same_first_token_active"))
            print(
                f"| {e['history']:,} | {e['full_prefill_s'] * 1e3:,.1f} ms | {e['resumed_active_s'] * 1e3:,.1f} ms | {e['speedup_active']:,.0f}x | "
                f"{e['resumed_gpu_s'] * 1e3:,.1f} ms | {e['speedup_gpu']:,.0f}x | "
                f"{e['resumed_host_s'] * 1e3:,.1f} ms | {e['speedup_host']:,.0f}x | {same} |"
            )


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
