"""LLMEngine: the synchronous engine loop (add requests, step, collect outputs). Knows nothing of HTTP."""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engram.args import EngineArgs
from engram.engine import memory_planner
from engram.engine.detokenizer import detokenize_step, find_stop_string, stop_prefix_len
from engram.engine.pools import HostCopier, KVPool, StatePool, capture_state, restore_state
from engram.engine.request import FinishReason, RequestOutput, SamplingParams, SlotNotRetainedError, StructuredOutputsParams
from engram.engine.runner import ModelRunner
from engram.engine.sampler import (
    prompt_token_logprobs,
    sample_batch,
    sample_on_device,
    samples_on_device,
    token_counts,
    token_logprob,
    token_mask,
)
from engram.engine.scheduler import ScheduledChunk, Scheduler
from engram.engine.sequence import Sequence, SequenceStatus
from engram.engine.spec_config import SpeculativeConfig, SpeculativeConfigError
from engram.engine.speculative import Speculator, unverified_kinds
from engram.engine.tensor_parallel import Leader, LeaderKVPool, LeaderStatePool, rank_state
from engram.engine.token_masks import bad_words_token_ids, mask_logits
from engram.engine.warmup import WarmupReport, install_compile_counter, kernel_compilations, name_late_compilations, warm_up
from engram.layers.parallel import local_spec
from engram.models.loader import load_model, load_model_from_state_dict
from engram.models.spec import load_model_spec
from engram.ops.dispatch import kernels, select_kernels, use_kernels
from engram.state.sequence_state import SequenceState, check_state
from engram.state.staging import DeviceStaging

if TYPE_CHECKING:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

    from engram.engine.grammar import Grammars

logger = logging.getLogger(__name__)
# Prompt logprobs take the logits of this many prompt positions at a time: 256 x vocabulary floats
# (128 MiB at a 128k vocabulary in float32) bound the memory, whatever the prefill chunk.
PROMPT_LOGITS_ROWS = 256


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    state_slots_used: int
    state_slots_total: int
    kv_blocks_used: int
    kv_blocks_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefill_tokens_computed_total: int
    cached_tokens_total: int
    num_preemptions: int
    retained_slots: int  # finished requests' slots kept (conversations' ACTIVE tier and the prefix cache's GPU tier), reclaimable
    graph_captures: int
    kernel_compilations: int  # Triton compilations in this process (0 without Triton)
    compilations_after_ready: int  # graph captures and compilations since `mark_ready` (should stay 0)
    captures_total: int = 0  # states captured at a request's end (final or prompt state)
    capture_bytes_total: int = 0  # bytes those captures copied device to host (only what the host lacked)
    prefix_slots: int = 0  # of retained_slots, the prefix cache's
    kv_blocks_retained: int = 0  # of kv_blocks_used, those the retained slots hold
    prefix_slot_hits_total: int = 0  # requests that adopted a prefix-cache slot found by their prompt (`prefix_slots`)
    spec_drafts_total: int = 0  # verify rows with a draft
    spec_draft_tokens_total: int = 0  # speculative tokens proposed and verified
    spec_accepted_tokens_total: int = 0  # of those, kept
    spec_accepted_per_position: tuple[int, ...] = ()  # drafts whose i-th token was kept, i < num_speculative_tokens


@dataclass
class InFlightTokens:
    """A step's tokens, chosen on the device and on their way to the host (one per sequence)."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # host copy, complete once `ready` has fired
    ready: torch.cuda.Event | None  # None on the CPU, where the copy is already done


def resolve_device(name: str) -> torch.device:
    """The device by name, a GPU always with its index: a tensor's device names its GPU as `cuda:0`,
    and torch.device equality tells that from a bare `cuda`."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None else device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA, float32 on CPU."""
    return memory_planner.resolve_dtype(name, "--dtype", torch.bfloat16 if device.type == "cuda" else torch.float32)


def load_tokenizer(model_path: Path) -> PreTrainedTokenizerBase | None:
    """The checkpoint's tokenizer, or None for a folder without one (token-id-only use)."""
    if not any((model_path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


def _on_host(state: SequenceState) -> bool:
    return all(t.device.type == "cpu" for t in state.all_tensors())


def _prefix_mismatch(tokens: list[int], state_len: int, prompt: list[int]) -> str | None:
    """Why a state of `state_len` tokens cannot start this prompt, or None when it can."""
    if state_len >= len(prompt):
        return f"the state covers {state_len} tokens but the prompt has only {len(prompt)}: nothing new to compute"
    if tokens[:state_len] != prompt[:state_len]:
        return "the state's tokens are not a prefix of the prompt"
    return None


class LLMEngine:
    def __init__(self, args: EngineArgs, weights: Mapping[str, torch.Tensor] | None = None):
        """`weights`: tensors under checkpoint names to use instead of the folder's safetensors
        (benchmarks run the engine on the weights of a `transformers` model already in memory)."""
        if args.model_path is None:
            raise ValueError("EngineArgs.model_path is required")
        self.args = args
        self.model_path = Path(args.model_path)
        self.spec = load_model_spec(self.model_path)
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.state_dtypes = memory_planner.state_dtypes(self.spec, self.dtype, args.mamba_ssm_dtype, args.kv_cache_dtype)
        self._kernels = select_kernels(self.device.type, args.enable_fast_ops)
        use_kernels(self._kernels)
        self.tokenizer = load_tokenizer(self.model_path)
        self.tp_leader = self._start_tensor_parallel(weights)
        # the other ranks stop with this engine: on close(), when it is collected, or at exit
        self._stop_ranks = weakref.finalize(self, self.tp_leader.close) if self.tp_leader is not None else None
        try:
            self._load_and_allocate(weights)
        except BaseException:
            self.close()  # the other ranks' processes do not outlive a failed start
            raise
        self.scheduler = Scheduler(
            self.state_pool,
            self.kv_pool,
            args.max_running_requests,
            args.max_num_batched_tokens,
            args.enable_mixed_chunk,
            args.scheduler_delay_factor,
        )
        self.copier = HostCopier(self.device)
        self.runner = ModelRunner(
            self.model,
            self.state_pool,
            self.kv_pool,
            self.device,
            enable_cuda_graph=args.enable_cuda_graph and self.tp_leader is None,
            max_context_length=self.max_context_length,
            max_prefill_graph_tokens=args.max_num_batched_tokens,
            batch_sink=self.tp_leader.forward if self.tp_leader is not None else None,
        )
        unverified = unverified_kinds(self.spec)  # a verify step keeps every position's state by mixer kind
        if args.speculative_config is not None and unverified:
            raise SpeculativeConfigError(
                f"--speculative-config: speculative decoding does not support the {' and '.join(unverified)} "
                f"layers of {self.spec.architecture} yet; leave the flag out"
            )
        self.speculator = (
            Speculator(
                SpeculativeConfig.parse(args.speculative_config),
                self.spec,
                self.state_pool,
                self.kv_pool,
                self.max_context_length,
                args.max_running_requests,
                self.device,
            )
            if args.speculative_config is not None
            else None
        )
        if self.speculator is not None and self.runner.graphs_on:  # verify steps of k + 1 tokens per sequence in graphs
            width = self.speculator.config.num_speculative_tokens + 1
            self.speculator.pad_drafts = self.runner.enable_verify_graphs(self.speculator.full_buffers(), width)
            self.speculator.commit_graphs = self.runner.verify_graphs
        # a speculative step's drafter reads the tokens of the step before: none may be in flight
        self._overlap = args.enable_overlap_schedule and self.speculator is None
        self.eos_token_ids = set(self.spec.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._requests: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []
        # Draws of requests without a seed of their own, on the device the logits live on.
        self._default_generator = torch.Generator(self.device).manual_seed(args.seed)
        self._counters = {"prompt": 0, "generation": 0, "prefill_computed": 0, "cached": 0, "captures": 0, "capture_bytes": 0, "prefix_slot_hits": 0}
        self._inflight: InFlightTokens | None = None
        self._grammars: Grammars | None = None  # made on the first structured request (xgrammar loads in seconds)
        self._grammars_lock = threading.Lock()
        install_compile_counter()
        self._work_at_ready: int | None = None  # graph captures + compilations when ready was marked

    def _load_and_allocate(self, weights: Mapping[str, torch.Tensor] | None) -> None:
        """The model (this rank's share), the memory plan, and the state and KV pools."""
        if self.tp_leader is not None:
            self.model = load_model(self.spec, self.model_path, self.dtype, self.device, self.tp_leader.tp)
        elif weights is None:
            self.model = load_model(self.spec, self.model_path, self.dtype, self.device)
        else:
            self.model = load_model_from_state_dict(self.spec, weights, self.dtype, self.device)
        # the shapes of this rank's share of each sequence's state: the pools' and the memory plan's
        self.shard_spec = local_spec(self.spec, self.args.tensor_parallel_size)
        self.plan = self._plan_memory()
        self.max_context_length = self.plan.context_length
        self.state_pool, self.kv_pool = self._pools()

    def _start_tensor_parallel(self, weights: Mapping[str, torch.Tensor] | None) -> Leader | None:
        """The other ranks' processes (None at --tensor-parallel-size 1, the single-process path)."""
        size = self.args.tensor_parallel_size
        if size < 1:
            raise ValueError(f"--tensor-parallel-size must be at least 1, got {size}")
        if size == 1:
            return None
        if weights is not None:
            raise ValueError("--tensor-parallel-size > 1 loads each rank's share from the checkpoint folder, not from in-memory weights")
        if self.args.speculative_config is not None:
            raise ValueError("--speculative-config is not supported with --tensor-parallel-size > 1 yet")
        return Leader(self.args, self.spec, self.device)

    def _pools(self) -> tuple[StatePool, KVPool]:
        """This rank's state and KV pools; under tensor parallelism, rank 0's, leading the others'."""
        args, spec, dtypes = self.args, self.shard_spec, self.state_dtypes
        if self.tp_leader is None:
            return (
                StatePool(spec, args.max_running_requests, dtypes, self.device),
                KVPool(spec, self.plan.num_kv_blocks, args.kv_block_size, dtypes.kv, self.device),
            )
        leader = self.tp_leader
        own = rank_state(args, self.spec, leader.tp, self.device, self.model)
        leader.start(own, args.max_running_requests, self.plan.num_kv_blocks)
        state_pool = LeaderStatePool(leader, spec, args.max_running_requests, dtypes, self.device)
        kv_pool = LeaderKVPool(leader, spec, self.plan.num_kv_blocks, args.kv_block_size, dtypes.kv, self.device)
        own.state_pool, own.kv_pool = state_pool, kv_pool
        return state_pool, kv_pool

    def close(self) -> None:
        """Stop the other tensor-parallel ranks' processes (nothing to do with one rank)."""
        if self._stop_ranks is not None:
            self._stop_ranks()

    def _plan_memory(self) -> memory_planner.MemoryPlan:
        plan = memory_planner.plan_for_args(
            self.shard_spec,
            self.args,
            model_dtype=self.dtype,
            total_memory_bytes=memory_planner.device_memory_bytes(self.device.type, self.args.cpu_memory_gb),
            weights_bytes=sum(p.numel() * p.element_size() for p in self.model.parameters()),
            cuda_graphs=self.device.type == "cuda" and self.args.enable_cuda_graph and self.tp_leader is None and self._kernels.graph_safe_decode,
        )
        return memory_planner.require_fit(plan)

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        initial_state: SequenceState | None = None,
        capture_state: bool = False,
        capture_prompt_state: bool = False,
        retain_key: str | None = None,
        resume_key: str | None = None,
        prefix_slots: str | None = None,
        require_adoption: bool = False,
        host_base: SequenceState | None = None,
        staged: DeviceStaging | None = None,
        internal: bool = False,
        grammar: Any = None,
        embed: bool = False,
    ) -> None:
        """Queue a request. `initial_state` covers a prefix of the prompt (restored, not computed);
        `resume_key` names a retained slot holding such a state (adopted without a copy when it is
        still there, else `initial_state` is used; with `require_adoption`, SlotNotRetainedError
        instead, so that the caller fetches the fallback state only then); `host_base`, the host copy of
        the retained slot's state (or of a prefix of it), lets the captures copy from the device
        only the KV past it (a restored `initial_state` serves so itself). `staged`: the load that
        read `initial_state` also copied it to this engine's device (`restore_device`,
        state/staging.py); its state is taken, the first restore copies from it on the device and
        drops it. `capture_state` returns the final state in the output; `capture_prompt_state` returns the state after the prompt (`prompt_state`: a
        prefix-cache entry; its recurrent part is copied when the prefill ends, its KV at finish);
        `retain_key` keeps the final state in its slot under that key. `prefix_slots` (a key
        namespace; the prefix cache's GPU tier) keeps it under `prefix_slots + request_id` as a
        prefix-cache slot (reclaimed before the others), and adopts the prefix-cache slot of that
        namespace that covers the longest prefix of the prompt, if longer than `initial_state`
        (which, in host memory, then serves as `host_base`). An `internal`
        request (the server's own, such as a prefill shared by several choices) is left out of
        the received, cached and generated token counts. `grammar`: `params.structured_outputs`
        as `compile_grammar` made it (else it is compiled here, on the caller's thread). `embed`:
        return the mean of the prompt's last hidden states (`embedding`; with max_tokens 0)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = list(prompt_token_ids)  # the request's own copy (lists compare with the states' token lists)
        matched = False  # the slot under resume_key was found by its tokens: it holds a prefix of this prompt
        if prefix_slots is not None:
            retain_key = retain_key or prefix_slots + request_id
            if resume_key is None:
                found = self.scheduler.longest_retained(prompt, prefix_slots, initial_state.state_len if initial_state is not None else 0)
                resume_key, matched = (found[0], True) if found is not None else (None, False)
        retained = self.scheduler.retained.get(resume_key) if resume_key is not None else None
        kept = retained if retained is not None and (matched or _prefix_mismatch(retained.tokens, retained.state_len, prompt) is None) else None
        if resume_key is not None and retained is not None and kept is None:  # not this prompt's state
            self.scheduler.drop_retained(resume_key)
        if require_adoption and kept is None:
            raise SlotNotRetainedError(f"no retained slot under {resume_key!r} holds a prefix of this prompt")
        if kept is not None and host_base is None and initial_state is not None and _on_host(initial_state):
            host_base = initial_state  # the captures copy from the device only the KV past it
        restored = kept.state_len if kept is not None else (initial_state.state_len if initial_state is not None else 0)
        self.check_request(prompt, params, restored)
        if (embed or params.prompt_logprobs is not None) and restored:
            raise ValueError(
                f"{'an embedding' if embed else 'prompt_logprobs'} needs every prompt token computed: {restored} of them come from a stored state"
            )
        bad_words = bad_words_token_ids(self.tokenizer, params.bad_words) if params.bad_words else []
        if host_base is not None:
            self._check_host_base(host_base, prompt, kept.state_len if kept is not None else None)
        if initial_state is not None:
            self._check_prefix(initial_state.tokens, initial_state.state_len, prompt)
            # Structure only: values were checked where the state came from (a verified snapshot
            # load, or this engine's own capture, which the health monitor also watches).
            check_state(self.spec, self.state_dtypes, initial_state, check_finite=False)
        staged_state = staged.take() if staged is not None else None
        if staged_state is not None:
            self._check_staged(staged_state, initial_state)
        if params.structured_outputs is not None and grammar is None:
            grammar = self.compile_grammar(params.structured_outputs)
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        seq = Sequence(request_id, prompt, params, generator, initial_state, capture_state, retain_key, internal)
        seq.capture_prompt, seq.retain_cache = capture_prompt_state, prefix_slots is not None
        seq.embed, seq.bad_words_ids = embed, bad_words
        seq.adopted = self.scheduler.adopt(resume_key) if resume_key is not None and kept is not None else None
        seq.host_base = host_base if kept is not None else None
        seq.staged_state = staged_state if kept is None else None  # an adopted slot needs no copy
        seq.matcher = self.grammars.matcher(grammar) if params.structured_outputs is not None else None
        seq.num_cached_tokens = seq.adopted.state_len if seq.adopted else (initial_state.state_len if initial_state else 0)
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        if not internal:
            self._counters["prompt"] += len(prompt)
            self._counters["cached"] += seq.num_cached_tokens
            self._counters["prefix_slot_hits"] += seq.adopted is not None and prefix_slots is not None

    def prefix_slot_covers(self, prompt_token_ids: list[int], prefix_slots: str) -> int:
        """How many leading tokens of the prompt a prefix-cache slot of the namespace `prefix_slots`
        holds (0: none): what `add_request(prefix_slots=)` would adopt now. Safe from any thread, and
        a hint: the slot may be reclaimed before the request comes."""
        found = self.scheduler.longest_retained(prompt_token_ids, prefix_slots)
        return found[1] if found is not None else 0

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, restored_prefix: int = 0) -> None:
        """What `add_request` refuses of a prompt and its parameters (ValueError); reads no engine
        state. The tokens of a `restored_prefix` (a state's, never computed) are checked against the
        vocabulary only when a repetition penalty reads them: a long conversation's resumed turn
        would otherwise check its whole history again."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        self.check_in_vocabulary("token ids", prompt_token_ids[restored_prefix if params.repetition_penalty == 1.0 else 0 :])
        self.check_in_vocabulary("logit_bias token ids", params.logit_bias or {})
        self.check_in_vocabulary("allowed_token_ids", params.allowed_token_ids or [])
        limit = self.max_context_length
        if len(prompt_token_ids) >= limit:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; the context length is {limit}")
        if params.max_tokens is not None and len(prompt_token_ids) + params.max_tokens > limit:
            raise ValueError(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context length {limit}")

    @property
    def grammars(self) -> Grammars:
        """The structured-output compiler of this engine's vocabulary (thread-safe)."""
        with self._grammars_lock:
            if self._grammars is None:
                from engram.engine.grammar import Grammars

                self._grammars = Grammars(self.tokenizer, self.spec.vocab_size, sorted(self.eos_token_ids))
            return self._grammars

    def compile_grammar(self, params: StructuredOutputsParams) -> Any:
        """The grammar of a request's structured outputs; any thread (compiling takes milliseconds to
        seconds, so the server calls it off the engine thread). A bad one raises ValueError naming
        `params.source`."""
        return self.grammars.compile(params)

    def check_in_vocabulary(self, what: str, token_ids: Iterable[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(f"{what} outside the vocabulary (0..{self.spec.vocab_size - 1}): {bad[:5]}")

    @staticmethod
    def _check_prefix(tokens: list[int], state_len: int, prompt: list[int]) -> None:
        reason = _prefix_mismatch(tokens, state_len, prompt)
        if reason is not None:
            raise ValueError(reason)

    def _check_host_base(self, base: SequenceState, prompt: list[int], retained_len: int | None) -> None:
        """A `host_base` must be a host state of this prompt's prefix, no longer than the adopted slot's."""
        reason = _prefix_mismatch(base.tokens, base.state_len, prompt)
        if reason is not None:
            raise ValueError(f"host_base: {reason}")
        if retained_len is not None and base.state_len > retained_len:
            raise ValueError(f"host_base covers {base.state_len} tokens, the retained slot only {retained_len}")
        if not _on_host(base):
            raise ValueError("host_base must be in host memory")
        check_state(self.spec, self.state_dtypes, base, check_finite=False)

    def _check_staged(self, staged: SequenceState, state: SequenceState | None) -> None:
        """`staged`'s state must be `initial_state`'s copy (its tokens and length) on the restore device."""
        if state is None:
            raise ValueError("staged: a copy of initial_state, which is missing")
        if staged.state_len != state.state_len or staged.tokens[: staged.state_len] != state.tokens[: state.state_len]:
            raise ValueError("staged: its state does not hold initial_state's tokens")
        if self.restore_device is None or any(t.device != self.device for t in staged.all_tensors()):
            raise ValueError(f"staged: its state must be on {self.restore_device or 'the restore device (this engine has none)'}")
        check_state(self.spec, self.state_dtypes, staged, check_finite=False)

    @property
    def restore_device(self) -> torch.device | None:
        """Where a load may copy a state for this engine while reading it (`staged`): the
        GPU of a one-rank engine; None on the CPU (the host copy is the device's) and under tensor
        parallelism (a restore broadcasts host tensors to the ranks)."""
        return self.device if self.device.type == "cuda" and self.tp_leader is None else None

    def release_retained(self, key: str) -> bool:
        """Free a retained slot (its state moves to the WARM tier through the captured copy)."""
        return self.scheduler.drop_retained(key)

    def abort_request(self, request_id: str) -> None:
        seq = self._requests.get(request_id)
        if seq is None or seq.is_finished:
            return
        self.scheduler.remove(seq)
        self._finish(seq, FinishReason.ABORT)
        self._aborted.append(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step. With overlapped scheduling, a step whose sequences all sample on the device
        (greedy or unseeded, without penalties or logprobs; grammars' masks applied there, filled
        once the tokens in flight are taken) picks its tokens there and returns before
        they are read: the next call launches the following step first (feeding those tokens from
        the device), then reads them while the GPU works. A sequence that then turns out to have
        stopped (EOS, stop token or string) has had its last token fed once more: its state covers
        all of its tokens."""
        outputs = [self._output(seq) for seq in self._aborted]
        self._aborted = []
        chunks, admitted = self.scheduler.schedule()
        for seq in admitted:  # the pages now hold the restored state's KV (none: recomputed, as after a preemption)
            seq.host_base = seq.initial_state if seq.initial_state is not None and _on_host(seq.initial_state) else None
            if seq.initial_state is not None:
                assert seq.slot is not None, "an admitted sequence holds a slot"
                started = time.perf_counter()
                restore_state(self.state_pool, self.kv_pool, seq.slot, seq.blocks, seq.staged_state or seq.initial_state)
                seq.staged_state = None  # a readmission (after a preemption) copies from the host state
                if self.device.type == "cuda":  # a real load into the pool, not a queued copy; this stream only:
                    torch.cuda.current_stream(self.device).synchronize()  # not the other loads' copies in flight
                seq.restore_seconds = time.perf_counter() - started
        logits, completing, launched = None, [], None
        verify = self.speculator.propose(chunks) if self.speculator is not None else None
        if chunks:
            if verify is not None:
                logits = self.runner.run(chunks, verify)
            elif any(c.prompt_rows for c in chunks):
                logits, hidden = self.runner.run_with_prompt_rows(chunks)
                for chunk, rows in zip(chunks, hidden):
                    if rows is not None:
                        self._take_prompt_rows(chunk, rows)
            else:
                logits = self.runner.run(chunks)
            for chunk in chunks:
                seq = chunk.seq
                self._counters["prefill_computed"] += max(0, min(chunk.start + chunk.length, seq.num_prompt_tokens) - chunk.start)
                seq.num_computed += chunk.length
                if seq.capture_prompt and seq.num_computed == seq.num_prompt_tokens and chunk.length:
                    assert seq.slot is not None, "a scheduled sequence holds a slot"
                    seq.prompt_recurrent = self._copy_recurrent(seq.slot)
            completing = [c.seq for c in chunks if c.completes]  # one logits row each, sampled unless finished
            outputs += [self._finish_prefill_only(seq) for seq in completing if seq.params.max_tokens == 0]
            if all(seq.is_finished for seq in completing):
                completing = []
            if completing and self._overlap and all(self._overlappable(s.params) for s in completing):
                masked = any(s.matcher is not None for s in completing)
                if self._inflight is not None and masked:
                    outputs += self._collect(self._inflight)  # their masks follow the tokens in flight
                    self._inflight = None
                launched = self._sample_on_device(logits, completing, masked)
        if self._inflight is not None:
            outputs += self._collect(self._inflight)
        self._inflight = launched
        if launched is not None:
            self._mark_inflight(launched)
        elif completing or verify is not None:
            assert logits is not None, "a step that completes sequences ran a forward"
            outputs += self._verify_and_append(logits, chunks) if verify is not None else self._sample_and_append(logits, completing)
        return outputs

    def _verify_and_append(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> list[RequestOutput]:
        """A speculative step's tokens (engine/speculative.py): row r of a chunk follows its r-th
        fed token; each sequence samples row after row, as plain decoding would, and goes on to
        row r + 1 while row r's token is its draft's r-th (and it has not finished)."""
        assert self.speculator is not None
        first, at = [], 0
        for c in chunks:
            first.append(at)
            at += c.length
        live = [(c, row) for c, row in zip(chunks, first) if not c.seq.is_finished]
        outputs = [c.seq for c, _ in live]
        # Plain greedy rows (no penalties, masks, grammar or logprobs: a row's token does not depend
        # on the tokens before it) take every row's argmax at once: one copy to the host.
        plain = all(c.seq.params.greedy and self._overlappable(c.seq.params) and c.seq.matcher is None for c, _ in live)
        argmax = kernels().argmax(logits).tolist() if plain and live else None
        r = 0
        while live:
            for c, _ in live:
                self.speculator.keep(c.seq, r + 1)
            if argmax is not None:
                tokens = [argmax[row + r] for _, row in live]
                for (c, _), token in zip(live, tokens):
                    self._append_token(c.seq, None, token)
            else:
                rows = torch.tensor([row + r for _, row in live], device=logits.device)
                tokens = self._append_sampled(logits[rows], [c.seq for c, _ in live])
            going = []
            for (c, row), token in zip(live, tokens):
                if r < len(c.draft) and token == c.draft[r]:  # a filler position (`ScheduledChunk.padding`) never goes on
                    self.speculator.accepted(r)
                    if not c.seq.is_finished:
                        going.append((c, row))
            live, r = going, r + 1
        self.speculator.end_step()
        return [self._output(seq) for seq in outputs]

    @torch.inference_mode()
    def _take_prompt_rows(self, chunk: ScheduledChunk, hidden: torch.Tensor) -> None:
        """Prompt logprobs and the embedding's sum from the last hidden states of `chunk.prompt_rows`.
        The state at position i gives the logprob of prompt token i + 1 (the last one's is sampled)."""
        seq, rows = chunk.seq, chunk.prompt_rows
        if seq.embed:
            total = hidden.float().sum(0)
            seq.hidden_sum = total if seq.hidden_sum is None else seq.hidden_sum + total
        if seq.params.prompt_logprobs is not None:
            scored = sum(p + 1 < seq.num_prompt_tokens for p in rows)  # the prompt's last position predicts no prompt token
            for at in range(0, scored, PROMPT_LOGITS_ROWS):
                end = min(at + PROMPT_LOGITS_ROWS, scored)
                logits = self.model.compute_logits(hidden[at:end])
                nexts = seq.prompt_token_ids[rows[at] + 1 : rows[end - 1] + 2]
                seq.prompt_logprobs += prompt_token_logprobs(logits, nexts, seq.params.prompt_logprobs)
        seq.prompt_rows_done = rows.stop

    def _copy_recurrent(self, slot: int) -> dict[str, torch.Tensor]:
        """A host copy (in flight on CUDA) of a slot's recurrent state as it is now: cloned on the
        compute stream first, so that the next step's in-place updates cannot race the copy."""
        return self.copier.copy({name: t.clone() for name, t in self.state_pool.views(slot).items()})[0]  # the KV copy's event covers it

    def _finish_prefill_only(self, seq: Sequence) -> RequestOutput:
        """Finish a sequence that samples nothing (max_tokens 0): its state covers the whole prompt."""
        self._finish(seq, FinishReason.LENGTH)
        return self._output(seq)

    @staticmethod
    def _overlappable(p: SamplingParams) -> bool:
        """Rows sampled on the device. A grammar's row is one too: its mask is filled once the tokens
        in flight are accepted, while the GPU runs this step's forward, and applied on the device."""
        return samples_on_device(p) and p.logprobs is None and not p.masks_tokens

    def _sample_on_device(self, logits: torch.Tensor, seqs: list[Sequence], masked: bool) -> InFlightTokens:
        """`masked`: some of `seqs` follow a grammar."""
        params = [seq.params for seq in seqs]
        if self.runner.argmax_in_sampled and all(p.greedy for p in params) and not masked:
            return InFlightTokens(seqs, *self.runner.argmax_on_host(len(seqs)))  # the decode graph sent them
        if masked:  # a row that finished meanwhile samples unmasked: its token is never read
            self.grammars.mask_logits(logits, [None if seq.is_finished else seq.matcher for seq in seqs])
        out = self.runner.writable_sampled(len(seqs))
        sample_on_device(logits, params, self._default_generator, out=out, argmax_done=self.runner.argmax_in_sampled and not masked)
        return InFlightTokens(seqs, *self.runner.copy_sampled_to_host(len(seqs)))

    def _mark_inflight(self, launched: InFlightTokens) -> None:
        """Sequences that go on after their in-flight token are scheduled on it; one that this token
        ends by length is not (it waits for the token alone)."""
        for row, seq in enumerate(launched.seqs):
            if seq.is_finished or self._ends_by_length(seq, len(seq.token_ids) + 1):
                continue
            seq.num_inflight, seq.inflight_row = 1, row

    def _collect(self, inflight: InFlightTokens) -> list[RequestOutput]:
        if inflight.ready is not None:
            inflight.ready.synchronize()
        outputs = []
        for seq, token in zip(inflight.seqs, inflight.tokens.tolist()):
            if seq.is_finished:  # aborted, or stopped, while its token was in flight
                continue
            seq.num_inflight = 0
            self._append_token(seq, None, token)
            outputs.append(self._output(seq))
        return outputs

    def _sample_and_append(self, logits: torch.Tensor, completing: list[Sequence]) -> list[RequestOutput]:
        """Sample on the host's terms (any parameters) for the sequences still going."""
        going = [i for i, seq in enumerate(completing) if not seq.is_finished]
        if len(going) < len(completing):
            logits = logits[torch.tensor(going, device=logits.device)]
            completing = [completing[i] for i in going]
        self._append_sampled(logits, completing)
        return [self._output(seq) for seq in completing]

    def _append_sampled(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """Sample a token for each sequence from its row (grammar masks, token masks, penalties,
        its own generator) and append it; the tokens."""
        if any(seq.matcher is not None for seq in seqs):
            self.grammars.mask_logits(logits, [seq.matcher for seq in seqs])
        if any(seq.params.masks_tokens for seq in seqs):
            mask_logits(logits, seqs, self.eos_token_ids)
        tokens = sample_batch(
            logits,
            [seq.params for seq in seqs],
            lambda i: (self._prompt_mask(seqs[i], logits), self._output_counts(seqs[i], logits)),
            [seq.generator for seq in seqs],
            self._default_generator,
        )
        for row, seq in enumerate(seqs):
            self._append_token(seq, logits[row], tokens[row])
        return tokens

    @staticmethod
    def _prompt_mask(seq: Sequence, logits: torch.Tensor) -> torch.Tensor | None:
        """The prompt's tokens over the vocabulary, made on first use (only the repetition penalty reads them)."""
        if seq.params.repetition_penalty == 1.0:
            return None
        if seq.prompt_mask is None:
            seq.prompt_mask = token_mask(seq.prompt_token_ids, logits.shape[-1], logits.device)
        return seq.prompt_mask

    @staticmethod
    def _output_counts(seq: Sequence, logits: torch.Tensor) -> torch.Tensor | None:
        """How often each token occurs in the output so far, made on first use from the output and
        then counted up by `_append_token` (only the penalties read it); None before any output."""
        if seq.output_counts is None and seq.num_output_tokens:
            seq.output_counts = token_counts(seq.output_token_ids, logits.shape[-1], logits.device)
        return seq.output_counts

    def _ends_by_length(self, seq: Sequence, num_tokens: int) -> bool:
        max_tokens = seq.params.max_tokens
        return (max_tokens is not None and num_tokens - seq.num_prompt_tokens >= max_tokens) or num_tokens >= self.max_context_length

    def _append_token(self, seq: Sequence, logits: torch.Tensor | None, token: int) -> None:
        p = seq.params
        if p.logprobs is not None:
            assert logits is not None, "logprobs are taken on the host's path, with the step's logits"
            seq.pending_logprobs.append(token_logprob(logits, token, p.logprobs))
        seq.token_ids.append(token)
        if seq.output_counts is not None:
            seq.output_counts[token] += 1
        if not seq.internal:
            self._counters["generation"] += 1
        chars_before = len(seq.text)
        # before min_tokens, neither a stop token (masked, but a grammar may end) nor a stop string ends it, as in vLLM
        early = seq.num_output_tokens < p.min_tokens
        stop_token = not early and ((not p.ignore_eos and token in self.eos_token_ids) or token in (p.stop_token_ids or ()))
        if seq.matcher is not None:
            stop_token |= self._grammar_ends(seq.matcher, seq.request_id, token)
        if not stop_token or p.include_stop_str_in_output:  # a stop token's text is left out, as in vLLM
            detokenize_step(self.tokenizer, seq)
        if stop_token:
            self._finish(seq, FinishReason.STOP, token)
        elif not early and (stop := find_stop_string(seq, len(seq.text) - chars_before)) is not None:
            self._finish(seq, FinishReason.STOP, stop)
        elif self._ends_by_length(seq, len(seq.token_ids)):
            self._finish(seq, FinishReason.LENGTH)

    @staticmethod
    def _grammar_ends(matcher: xgr.GrammarMatcher, request_id: str, token: int) -> bool:
        """Advance a request's grammar by its token; True once the grammar has ended (it accepts an
        EOS token only where the output is complete, even under ignore_eos)."""
        if not matcher.accept_token(token):  # the mask allowed it: a bug, not the request's fault
            raise RuntimeError(f"the grammar of request {request_id} rejected token {token} that its mask allowed")
        return matcher.is_terminated()

    def _finish(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        if reason != FinishReason.ABORT and seq.slot is not None:
            if self.speculator is not None:  # mid-verify: the state after the tokens kept, before it is captured
                self.speculator.commit([seq])
            copied = self.copier.bytes_copied
            if seq.capture_state:
                seq.captured_state = capture_state(
                    self.state_pool, self.kv_pool, self.copier, seq.slot, seq.blocks, seq.token_ids, seq.num_computed, seq.host_base
                )
            if seq.prompt_recurrent is not None:  # the prompt's KV is still in its pages, unchanged
                seq.prompt_state = capture_state(
                    self.state_pool,
                    self.kv_pool,
                    self.copier,
                    seq.slot,
                    seq.blocks,
                    seq.prompt_token_ids,
                    seq.num_prompt_tokens,
                    seq.host_base,
                    recurrent=seq.prompt_recurrent,
                )
            if seq.capture_state or seq.prompt_recurrent is not None:
                self._counters["captures"] += 1
                self._counters["capture_bytes"] += self.copier.bytes_copied - copied
            if seq.retain_key is not None:
                seq.retained = self.scheduler.retain(seq.retain_key, seq, cache=seq.retain_cache)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.scheduler.remove(seq)

    def _output(self, seq: Sequence) -> RequestOutput:
        p = seq.params
        new_ids = seq.output_ids(seq.emitted_tokens)
        text_end = len(seq.text) - (0 if seq.is_finished else stop_prefix_len(seq))
        out = RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=seq.text[:text_end],  # what has been emitted (text that may begin a stop string waits)
            new_token_ids=new_ids,
            new_text=seq.text[seq.emitted_chars : text_end],
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=seq.pending_logprobs if seq.params.logprobs is not None else None,
            num_cached_tokens=seq.num_cached_tokens,
            restore_seconds=seq.restore_seconds,
            queue_seconds=seq.queue_seconds,
            state=seq.captured_state,
            prompt_state=seq.prompt_state,
            prompt_logprobs=seq.prompt_logprobs if p.prompt_logprobs is not None and not seq.wants_prompt_rows else None,
            embedding=(seq.hidden_sum / seq.num_prompt_tokens).tolist() if seq.embed and seq.is_finished and seq.hidden_sum is not None else None,
            retained=seq.retained,
        )
        seq.emitted_tokens += len(new_ids)
        seq.emitted_chars = text_end
        seq.pending_logprobs = []
        if seq.is_finished:
            self._requests.pop(seq.request_id, None)
        return out

    # ---- start-up ------------------------------------------------------------------------------

    def warm_up(self, on_stage: Callable[[str, int, int], None] | None = None) -> WarmupReport:
        """Capture every CUDA graph and compile every kernel path now (engine/warmup.py). Its
        requests are not traffic: the token counters, preemption count, speculative counts and
        default generator are left as they were."""
        counters, preemptions = dict(self._counters), self.scheduler.num_preemptions
        generator = self._default_generator.get_state()
        spec_stats = copy.deepcopy(self.speculator.stats) if self.speculator is not None else None
        try:
            return warm_up(self, on_stage)
        finally:
            self._counters.update(counters)
            self.scheduler.num_preemptions = preemptions
            self._default_generator.set_state(generator)
            if self.speculator is not None and spec_stats is not None:
                self.speculator.stats = spec_stats

    def mark_ready(self) -> None:
        """From now on graph captures and compilations are counted as happening on a request's path."""
        self._work_at_ready = self._compile_work()
        self.runner.ready = True
        name_late_compilations()

    def describe(self) -> dict[str, str]:
        """What this engine runs with, for the server's start-up banner."""
        fmt, p = memory_planner.format_bytes, self.plan
        return {
            "model": f"{self.model_path} ({self.spec.architecture}, {self.spec.model_type})",
            "dtype": f"{memory_planner.dtype_name(self.dtype)} (conv state {p.conv_state_dtype}, SSM state {p.ssm_state_dtype}, KV {p.kv_cache_dtype})",
            "device": f"{self.device}; kernels {self._kernels.name} (fast ops {'on' if self.args.enable_fast_ops else 'off'}), "
            f"CUDA graphs {'on' if self.runner.graphs_on else 'off'}, overlap schedule {'on' if self.args.enable_overlap_schedule else 'off'}",
            "memory": f"weights {fmt(p.weights_bytes)}, state {fmt(p.state_bytes_per_seq)} x {p.max_running_requests} running = "
            f"{fmt(p.state_cache_bytes)}, KV {p.max_total_tokens:,} tokens = {fmt(p.kv_cache_bytes)} (budget {fmt(p.budget_bytes)})",
            "limits": f"context length {self.max_context_length:,}, max running requests {self.args.max_running_requests}, "
            f"{self.args.max_num_batched_tokens} tokens per step",
        }

    def _compile_work(self) -> int:
        return self.runner.num_graph_captures + kernel_compilations()

    # ---- introspection ------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        c = self._counters
        after_ready = self._compile_work() - self._work_at_ready if self._work_at_ready is not None else 0
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            state_slots_used=self.state_pool.num_used,
            state_slots_total=self.state_pool.num_slots,
            kv_blocks_used=self.kv_pool.num_used,
            kv_blocks_total=self.kv_pool.num_blocks,
            prompt_tokens_total=c["prompt"],
            generation_tokens_total=c["generation"],
            prefill_tokens_computed_total=c["prefill_computed"],
            cached_tokens_total=c["cached"],
            num_preemptions=self.scheduler.num_preemptions,
            retained_slots=len(self.scheduler.retained),
            prefix_slots=self.scheduler.num_cache_slots,
            kv_blocks_retained=sum(len(kept.blocks) for kept in self.scheduler.retained.values()),
            captures_total=c["captures"],
            capture_bytes_total=c["capture_bytes"],
            prefix_slot_hits_total=c["prefix_slot_hits"],
            graph_captures=self.runner.num_graph_captures,
            kernel_compilations=kernel_compilations(),
            compilations_after_ready=after_ready,
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, Any]:
        if self.speculator is None:
            return {}
        st = self.speculator.stats
        return {
            "spec_drafts_total": st.drafts,
            "spec_draft_tokens_total": st.draft_tokens,
            "spec_accepted_tokens_total": st.accepted_tokens,
            "spec_accepted_per_position": tuple(st.accepted_per_position),
        }

    def flush_cache(self) -> bool:
        """Free every retained slot (the ACTIVE tier); refused while requests are running."""
        if self.scheduler.has_work():
            return False
        for key in list(self.scheduler.retained):
            self.scheduler.drop_retained(key)
        return True
