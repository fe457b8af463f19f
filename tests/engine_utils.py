"""Helpers for driving an LLMEngine directly in tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engram.args import EngineArgs
from engram.engine.engine import LLMEngine
from engram.engine.request import RequestOutput, SamplingParams
from engram.state.chunks import STORE_NAME
from engram.state.conversations import ConversationManager
from engram.state.identity import ModelIdentity, tokenizer_fingerprint
from engram.state.store import WarmCache
from engram.state.tiers import SnapshotPolicy


def make_engine(path: str, **overrides) -> LLMEngine:
    args = dict(model_path=path, max_total_tokens=4096, max_running_requests=8, max_num_batched_tokens=512)
    return LLMEngine(EngineArgs(**{**args, **overrides}))


class ContinuationDrafter:
    """Drafts the known greedy continuation (`outputs`: prompt + output of each request) of whichever
    sequence it is asked for, of a length that varies with the position (0 to k: short drafts, some
    steps with none), each token off by one with `wrong` (every draft rejected)."""

    def __init__(self, outputs: list[list[int]], wrong: bool = False):
        self.outputs, self.wrong = outputs, wrong

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        full = next(o for o in self.outputs if o[: len(token_ids)] == token_ids)
        draft = full[len(token_ids) : len(token_ids) + min(k, len(token_ids) % 5)]
        return [t - 1 if t else 1 for t in draft] if self.wrong else draft  # another token, still in the vocabulary


class ReferenceDrafter:
    """Drafts the target's own greedy continuation (transformers), or with `wrong` a token off by one
    at each position: every draft accepted, or every draft rejected. With `mixed` only the first
    len(token_ids) % (k + 1) tokens are right: drafts kept in part, rolled back at every position."""

    def __init__(self, ref: torch.nn.Module, wrong: bool = False, mixed: bool = False):
        self.ref, self.wrong, self.mixed = ref, wrong, mixed

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        draft: list[int] = []
        for _ in range(k):  # full forwards, no cache: transformers' cached generate drifts after some prompt lengths
            with torch.no_grad():
                draft.append(int(self.ref(torch.tensor([token_ids + draft])).logits[0, -1].argmax()))
        right = 0 if self.wrong else len(token_ids) % (k + 1) if self.mixed else k
        return draft[:right] + [(t + 1) % self.ref.config.vocab_size for t in draft[right:]]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def run_to_end(engine: LLMEngine) -> dict[str, RequestOutput]:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def record_logits(engine: LLMEngine) -> list[torch.Tensor]:
    """Every logits tensor the runner returns from now on, in order."""
    seen: list[torch.Tensor] = []
    run = engine.runner.run

    def recording(chunks):
        logits = run(chunks)
        seen.append(logits.clone())
        return logits

    engine.runner.run = recording
    return seen


def assert_greedy_matches_transformers(engine: LLMEngine, ref: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """Decode `prompt` greedily; every step's logits must match transformers' forward over the same
    tokens (to 1e-4) and the tokens its generate. Returns the tokens."""
    logits = record_logits(engine)
    engine.add_request("parity", prompt, greedy(max_tokens))
    out = run_to_end(engine)["parity"]
    with torch.no_grad():
        ref_tokens = ref.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(prompt) :
        ].tolist()
        ref_logits = ref(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
    assert len(logits) == max_tokens and all(step.shape[0] == 1 for step in logits)
    assert (torch.cat(logits) - ref_logits).abs().max().item() < 1e-4
    assert out.token_ids == ref_tokens
    return ref_tokens


def random_prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def store_file(manifest_path: Path, piece: int | None = None) -> Path:
    """The store file a turn's v2 manifest names: its checkpoint, or its `piece`-th KV piece."""
    refs = json.loads(manifest_path.read_text())["store"]
    kind, key = ("ckpt", refs["checkpoint"][0]) if piece is None else ("kv", refs["pieces"][piece][2])
    return manifest_path.parents[2] / STORE_NAME / kind / key[:2] / f"{key}.safetensors"


def manager_of(
    engine: LLMEngine, root: Path | str | None, policy: SnapshotPolicy | None = None, warm: WarmCache | None = None, **fields: Any
) -> ConversationManager:
    """A ConversationManager for `engine`'s model with snapshots under `root`; `fields` are the
    constructor's keywords (tiers, chunk_tokens, store_url, ...)."""
    return ConversationManager(
        engine.spec,
        engine.state_dtypes,
        ModelIdentity.of(engine.spec, engine.model_path),
        tokenizer_fingerprint(engine.model_path),
        policy or SnapshotPolicy(),
        root,
        warm if warm is not None else WarmCache(64, 1 << 30),
        **fields,
    )


# Ops that make no kernel of their own (views): left out of the op counts.
VIEW_OPS = {
    "aten::" + name
    for name in "alias as_strided chunk detach expand flatten narrow permute reshape select slice split squeeze t transpose unbind unflatten unfold unsqueeze view".split()
}
LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}


def _ancestors(e):
    parent = e.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def launch_counts(events, within: str | None = None) -> dict:
    """Launches as the torch profiler saw them (inside the region named `within`, if given): top-level
    aten ops that compute (views left out), and on CUDA the kernel launches and graph replays."""
    counts = {"aten_ops": 0, "kernel_launches": 0, "graph_launches": 0}
    for e in events:
        names = [p.name for p in _ancestors(e)]
        if within is not None and within not in names:
            continue
        if e.name in LAUNCHES:
            counts["kernel_launches"] += 1
        elif e.name == "cudaGraphLaunch":
            counts["graph_launches"] += 1
        elif e.name.startswith("aten::") and e.name not in VIEW_OPS:
            counts["aten_ops"] += not any(n.startswith("aten::") for n in names)
    return counts
