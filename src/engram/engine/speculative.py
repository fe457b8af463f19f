"""Speculative decoding: drafts for a step's decode rows, their verification buffers, and the
commit of each sequence's recurrent state after its accepted tokens.

A verify chunk feeds a sequence's last sampled token and its draft d_1..d_k in one forward
(`ScheduledChunk.draft`); its k + 1 logits rows are sampled in order by the engine
(`LLMEngine._verify_and_append`), and row r's token is kept while row r - 1's was the draft's
d_r. With a drafter that proposes tokens, not distributions (n-gram: q is one-hot), that is
Leviathan et al.'s rejection rule exactly: d_r is accepted with probability p(d_r), and on
rejection the token drawn from p conditioned on "not d_r" is the residual norm(max(0, p - q)).
So every kept token is a draw from the target distribution given its prefix, with the request's
own sampler (penalties, grammar masks, logprobs and seeds included). A drafter with a
distribution of its own (MTP) would replace this rule with the general one.

Attention wrote KV for all k + 1 positions; the rejected entries lie past `num_computed` and are
overwritten when those positions are fed again (pages past the kept tokens go back to the pool).
Recurrent layers wrote nothing to the pool (ops/verify.py): each declared state tensor of every
recurrent layer has a buffer in the step's `VerifyStates` (`StateTensor.verify_shape`: a conv
window, or a scan's state after each position), which the layer fills. `commit` writes the state
after the kept tokens, tensor by tensor, lazily: before a finishing sequence's state is captured,
or at the end of the step. The mixer kinds whose layers fill their buffers are `VERIFIED_KINDS`;
the engine refuses `--speculative-config` for a model with any other kind that keeps state.

With CUDA graphs on, every chunk is padded to k + 1 fed tokens (`pad_drafts`) and a verify step
replays a graph of its batch bucket, its commit another (engine/verify_graphs.py); otherwise it
runs eagerly. Overlap scheduling is off while speculation is on: the drafter needs each step's
tokens on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from engram.cache.forward_batch import VerifyStates
from engram.cache.views import StateCache
from engram.engine.drafter import Drafter, NgramDrafter
from engram.engine.pools import KVPool, StatePool
from engram.engine.scheduler import ScheduledChunk
from engram.engine.sequence import Sequence
from engram.engine.spec_config import SpeculativeConfig
from engram.models.spec import LayerKind, ModelSpec, StateRole
from engram.ops.dispatch import kernels
from engram.ops.verify import verify_layout

# The mixer kinds whose layers fill a verify step's buffers instead of writing the pool.
VERIFIED_KINDS = frozenset({LayerKind.MAMBA, LayerKind.GATED_DELTANET, LayerKind.SHORT_CONV})


def unverified_kinds(spec: ModelSpec) -> list[str]:
    """The model's mixer kinds that keep state but have no verify step (speculation is refused for them)."""
    kinds = {k for mixers in spec.layer_mixers for k in mixers if spec.mixer_state_tensors(k)}
    return sorted(k.value for k in kinds - VERIFIED_KINDS)


class CommitGraphs(Protocol):
    def commit(self, entries: list[list[int]]) -> bool:
        """`commit_layers` of entries [slots, rows, fed] (host lists) from the widest step's buffers;
        False: not done (no graph of that many entries)."""
        ...


def commit_layers(state_pool: StateCache, buffers: VerifyStates, slots: torch.Tensor, rows: torch.Tensor, fed: torch.Tensor) -> None:
    """Into each buffered state tensor's pool slots[i]: the state after fed[i] tokens of row rows[i] of `buffers`."""
    k = kernels()
    for (layer, suffix), windows in buffers.windows.items():
        k.commit_windows(state_pool.of(layer, suffix), slots, windows, rows, fed)
    for (layer, suffix), states in buffers.states.items():
        k.commit_states(state_pool.of(layer, suffix), slots, states, rows, fed)


@dataclass
class SpeculativeStats:
    draft_tokens: int = 0  # tokens proposed and verified
    accepted_tokens: int = 0  # of those, kept
    drafts: int = 0  # verify chunks with a draft
    accepted_per_position: list[int] = field(default_factory=list)  # [k]: drafts whose token at position i was kept


@dataclass
class _Pending:
    row: int  # the sequence's row in the step's VerifyStates
    start: int  # its num_computed before the step
    fed: int = 1  # tokens of its chunk that its state keeps


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        spec: ModelSpec,
        state_pool: StatePool,
        kv_pool: KVPool,
        max_context_length: int,
        max_seqs: int,
        device: torch.device,
    ):
        self.config, self.spec, self.device = config, spec, device
        self.state_pool, self.kv_pool = state_pool, kv_pool
        self.max_context_length = max_context_length
        self.max_seqs = max_seqs
        self.drafter: Drafter = NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpeculativeStats(accepted_per_position=[0] * config.num_speculative_tokens)
        # Every chunk fed k + 1 tokens (filler after a short draft) where it can be: the width of the
        # runner's verify graphs, set when they are on.
        self.pad_drafts = False
        self._pending: dict[Sequence, _Pending] = {}
        self._verify: VerifyStates | None = None
        self._full: VerifyStates | None = None  # the widest step's buffers, made on first use and kept
        self.commit_graphs: CommitGraphs | None = None  # commits replayed from graphs (with the runner's verify graphs)

    def _draft_limit(self, seq: Sequence) -> int:
        """Draft tokens this sequence may verify: never past max_tokens (a step keeps at most the
        draft plus one token) nor the context length (the last fed position)."""
        k = self.config.num_speculative_tokens
        if seq.params.max_tokens is not None:
            k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
        return min(k, self.max_context_length - len(seq.token_ids))

    def propose(self, chunks: list[ScheduledChunk]) -> VerifyStates | None:
        """Drafts onto the decode rows of a step of decode rows only (a prefill chunk would need every
        position's state too), in free KV pages only (never reclaiming a retained slot's nor
        preempting); the step's buffers, or None: no draft."""
        if not chunks or not all(c.length == 1 and c.start > 0 and c.completes and not c.seq.num_inflight for c in chunks):
            return None
        for c in chunks:
            seq = c.seq
            draft = self.drafter.propose(seq.token_ids, self._draft_limit(seq))
            if draft and self._fits(seq, c.start + 1 + len(draft)):
                c.draft = draft
                c.length += len(draft)
        if not any(c.draft for c in chunks):
            return None
        if self.pad_drafts:
            self._pad(chunks)
        self._pending = {c.seq: _Pending(row, c.start) for row, c in enumerate(chunks)}
        self._verify = self._step_buffers([c.length for c in chunks])
        self.stats.drafts += sum(bool(c.draft) for c in chunks)
        self.stats.draft_tokens += sum(len(c.draft) for c in chunks)
        return self._verify

    def _fits(self, seq: Sequence, tokens: int) -> bool:
        """KV pages for `tokens` tokens of this sequence, taken from the free ones if it lacks them."""
        need = self.kv_pool.blocks_for(tokens) - len(seq.blocks)
        if need > self.kv_pool.num_free:
            return False
        if need > 0:
            seq.blocks.extend(self.kv_pool.allocate(need))
        return True

    def _pad(self, chunks: list[ScheduledChunk]) -> None:
        """Every chunk to k + 1 fed tokens, when each has the context room and the pages for it
        (else the step stays as drafted, and runs eagerly)."""
        width = self.config.num_speculative_tokens + 1
        if any(self.max_context_length - len(c.seq.token_ids) < width - 1 for c in chunks):
            return
        if all(self._fits(c.seq, c.start + width) for c in chunks):
            for c in chunks:
                c.padding = width - c.length
                c.length = width

    def _buffers(self, num_seqs: int, length: int) -> VerifyStates:
        """Buffers of a step of num_seqs sequences feeding `length` tokens each: one per state tensor
        of every recurrent layer, in its pool's dtype."""
        windows: dict[tuple[int, str], torch.Tensor] = {}
        states: dict[tuple[int, str], torch.Tensor] = {}
        for i in self.spec.recurrent_layers:
            for t in self.spec.state_tensors(i):
                pool = self.state_pool.of(i, t.suffix)
                buffer = torch.empty(num_seqs, *t.verify_shape(length), dtype=pool.dtype, device=pool.device)
                (windows if t.role is StateRole.CONV else states)[i, t.suffix] = buffer
        rows, flat = verify_layout([length] * num_seqs, self.device)
        return VerifyStates(windows, states, rows, flat)

    def full_buffers(self) -> VerifyStates:
        """The widest step's buffers (max_seqs sequences of k + 1 tokens), kept: every step's are views of
        them, so that a CUDA graph captured on them serves every step of its shape."""
        if self._full is None:
            self._full = self._buffers(self.max_seqs, self.config.num_speculative_tokens + 1)
        return self._full

    def _step_buffers(self, seq_lens: list[int]) -> VerifyStates:
        full, n, length = self.full_buffers(), len(seq_lens), max(seq_lens)
        if length == full.rows.shape[1] and min(seq_lens) == length:  # a padded step: its layout is the widest's (no copy)
            rows, flat = full.rows[:n], full.flat[: n * length]
        else:
            rows, flat = verify_layout(seq_lens, self.device)
        return full.narrowed(n, length, rows, flat)

    def keep(self, seq: Sequence, fed: int) -> None:
        """The sequence's state is to cover `fed` tokens of its verify chunk (its num_computed now says so)."""
        pending = self._pending[seq]
        pending.fed = fed
        seq.num_computed = pending.start + fed

    def accepted(self, position: int) -> None:
        self.stats.accepted_tokens += 1
        self.stats.accepted_per_position[position] += 1

    def commit(self, seqs: list[Sequence]) -> None:
        """Write the kept state of these sequences into their slots and free their pages past it."""
        done = [(seq, slot, self._pending.pop(seq)) for seq in seqs if seq in self._pending and (slot := seq.slot) is not None]
        if not done or self._verify is None:
            return
        if self._verify.windows or self._verify.states:
            entries = [[slot for _, slot, _ in done], [p.row for _, _, p in done], [p.fed for _, _, p in done]]
            if self.commit_graphs is None or not self.commit_graphs.commit(entries):
                slots, rows, fed = torch.tensor(entries).to(self.device)
                commit_layers(self.state_pool, self._verify, slots, rows, fed)
        for seq, _, _ in done:
            keep = self.kv_pool.blocks_for(seq.num_tokens)
            self.kv_pool.free(seq.blocks[keep:])
            del seq.blocks[keep:]

    def end_step(self) -> None:
        """Commit every sequence still pending and drop the step's buffers."""
        self.commit(list(self._pending))
        self._pending, self._verify = {}, None
