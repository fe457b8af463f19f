"""Engine and server arguments. CLI flags are generated from the dataclass fields:
`max_running_requests` becomes `--max-running-requests`, and every bool gets `--x/--no-x`."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field

from engram.models.builtin import DEFAULT_MODEL


@dataclass
class EngineArgs:
    model_path: str | None = field(
        default=None,
        metadata={
            "help": "checkpoint folder, or a built-in model: embedded (tiny, random) or demo (trained on Python's standard library); "
            f"default: {DEFAULT_MODEL}"
        },
    )
    dtype: str = field(default="auto", metadata={"help": "auto|float32|bfloat16|float16 (auto: float32 on CPU, bfloat16 on CUDA)"})
    device: str = field(default="auto", metadata={"help": "auto|cpu|cuda"})
    max_running_requests: int = field(default=16, metadata={"help": "sequences decoded at once; each holds one recurrent-state slot"})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "tokens per engine step (prefill chunk budget)"})
    context_length: int | None = field(
        default=None, metadata={"help": "longest sequence (default: the model's max_position_embeddings, capped by the KV cache)"}
    )
    max_total_tokens: int | None = field(default=None, metadata={"help": "KV cache size in tokens (default: from the memory budget)"})
    mem_fraction_static: float = field(default=0.85, metadata={"help": "fraction of device memory for weights, state and KV"})
    cpu_memory_gb: float = field(default=4.0, metadata={"help": "memory budget on CPU, where there is no device memory to query"})
    kv_block_size: int = field(default=16, metadata={"help": "tokens per KV page"})
    mamba_ssm_dtype: str = field(
        default="float32", metadata={"help": "dtype of the SSM state: float32|bfloat16|float16|auto (auto: the model dtype)"}
    )
    kv_cache_dtype: str = field(default="auto", metadata={"help": "auto (the model dtype)|float32|bfloat16|float16"})
    seed: int = field(default=0, metadata={"help": "seed of the sampler for requests without their own"})
    enable_fast_ops: bool = field(default=True, metadata={"help": "use fused CUDA kernels where available (torch references otherwise)"})
    enable_cuda_graph: bool = field(default=True, metadata={"help": "capture decode steps in CUDA graphs"})
    enable_mixed_chunk: bool = field(
        default=False,
        metadata={
            "help": "run prefill chunks in the same steps as decode rows (as SGLang's flag; such steps run eagerly); off: the two kinds of step take turns, so that decode steps replay their CUDA graph"
        },
    )
    scheduler_delay_factor: float = field(
        default=0.0,
        metadata={
            "help": "while requests decode, admit waiting ones once the oldest has waited this many times the last admitting step's time (vLLM's flag), so that arrivals share prefill steps; 0: at once"
        },
    )
    enable_overlap_schedule: bool = field(
        default=True,
        metadata={
            "help": "pick tokens on the device (greedy, or sampled without penalties, logprobs or a seed) and launch the next step before reading them back, so that the host's work overlaps the GPU's"
        },
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "ranks the model is split over, one process each (NCCL on CUDA, one GPU per rank; gloo on CPU): "
            "heads, groups and MLP/expert widths must divide by it; snapshots do not depend on it",
            "aliases": ("--tp", "--tp-size"),
        },
    )
    speculative_config: str | None = field(
        default=None,
        metadata={
            "help": 'speculative decoding, as vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": k, '
            '"prompt_lookup_max": n, "prompt_lookup_min": m} (prompt lookup, no extra weights; exact under greedy '
            "and sampling). Verify steps run eagerly, and overlap scheduling is off while it is on"
        },
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp: typing.Any) -> type:
    """`X` of `X | None`; other types as they are."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args and type(None) in typing.get_args(tp) else tp


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = _base_type(hints[f.name])
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        help_text = f.metadata.get("help", "")
        names = (_flag(f.name), *f.metadata.get("aliases", ()))
        if kind is bool:
            parser.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif typing.get_origin(kind) is list:  # a repeatable flag
            parser.add_argument(*names, dest=f.name, action="append", type=typing.get_args(kind)[0], default=default, help=help_text)
        else:
            choices = f.metadata.get("choices")
            parser.add_argument(*names, dest=f.name, type=kind, default=default, choices=choices, help=help_text)


def from_namespace(cls: type, ns: argparse.Namespace):
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(ns).items() if k in names})


@dataclass
class ServerArgs:
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=30000, metadata={"help": "port to listen on"})
    served_model_name: str | None = field(
        default=None, metadata={"help": "model name in the API (default: the model folder's name, or the built-in model's)"}
    )
    api_key: list[str] = field(
        default_factory=list,
        metadata={
            "help": "require `Authorization: Bearer <key>` on every route but /health, /health_generate and /metrics; "
            "repeat it for several tenants, each seeing only its own conversations"
        },
    )
    api_keys_file: str | None = field(default=None, metadata={"help": "file of `name: key` lines, one tenant each (re-read on SIGHUP)"})
    admin_api_key: str | None = field(
        default=None, metadata={"help": "key for admin routes (cache flush, request aborts, snapshots); without it they take --api-key"}
    )
    enable_warmup: bool = field(
        default=True, metadata={"help": "capture every CUDA graph and compile the kernels before /health answers 200 (nothing to do on the CPU)"}
    )
    max_request_bytes: int = field(default=16 << 20, metadata={"help": "largest request body; a larger one gets 413 before it is parsed"})
    max_import_bytes: int = field(default=64 << 30, metadata={"help": "largest conversation file POST /v1/conversations/import takes"})
    log_level: str = field(default="info", metadata={"help": "logging level", "choices": ["critical", "error", "warning", "info", "debug"]})
    enable_snapshot_persistence: bool = field(
        default=True, metadata={"help": "write conversation snapshots to --snapshot-dir so they survive restarts"}
    )
    snapshot_dir: str | None = field(
        default=None, metadata={"help": "snapshot folder (default: $ENGRAM_CACHE_DIR/snapshots or ~/.cache/engram/snapshots)"}
    )
    snapshot_store: str | None = field(
        default=None,
        metadata={
            "help": "where snapshots and conversation records are kept: a folder or file:// URL (as --snapshot-dir), or an object "
            "store shared by replicas (s3://bucket/prefix, gs://, az://; needs engram[s3]; credentials and endpoint "
            "from AWS_*, GOOGLE_*, AZURE_*), with --snapshot-dir as its local cache; default: --snapshot-dir"
        },
    )
    snapshot_retention_count: int = field(default=0, metadata={"help": "snapshots kept per conversation branch, oldest deleted first; 0 keeps all"})
    snapshot_trigger_policy: str = field(
        default="every_turn",
        metadata={"help": "when a turn is snapshotted", "choices": ["every_turn", "every_n_turns", "on_tool_call", "manual_only"]},
    )
    snapshot_every_n_turns: int = field(default=1, metadata={"help": "with --snapshot-trigger-policy every_n_turns: snapshot turns n, 2n, ..."})
    max_warm_conversations: int = field(
        default=256,
        metadata={
            "help": "conversations whose states are kept in host memory (a conversation may hold several turns' states; --max-warm-memory-gb bounds their bytes)"
        },
    )
    max_warm_memory_gb: float = field(default=4.0, metadata={"help": "host memory for conversation states"})
    pinned_load_memory_gb: float = field(
        default=4.0,
        metadata={
            "help": "host memory page-locked once at start-up (on CUDA; rounded down to a power of two) that cold loads read states "
            "into, for their WARM copies; a load it cannot hold page-locks its own memory, which costs about as much as the read; 0: none"
        },
    )
    enable_prefix_caching: bool = field(
        default=True,
        metadata={
            "help": "a request of no conversation starts from the state of the longest earlier prompt it begins with "
            "(a client that resends its history); its own prompt's state is kept for the next"
        },
    )
    prefix_cache_memory_gb: float = field(default=2.0, metadata={"help": "host memory for the prefix cache's states"})
    prefix_cache_disk_gb: float = field(
        default=16.0,
        metadata={
            "help": "disk under --snapshot-dir for the prefix cache's states, which survive restarts (0, or no snapshot persistence: host memory only)"
        },
    )
    prefix_cache_min_tokens: int = field(
        default=2048,
        metadata={
            "help": "shortest prompt whose state the prefix cache keeps (a shorter one costs less to compute again than its "
            "state costs to copy out: on the H200 capturing every 512-token prompt halved 16- and 64-client throughput)"
        },
    )
    state_chunk_tokens: int = field(
        default=256, metadata={"help": "tokens per KV piece in the snapshot store (pieces are shared by every prefix that holds them)"}
    )
    enable_memory_tiers: bool = field(
        default=True,
        metadata={
            "help": "keep finished conversations' states in engine slots (ACTIVE) and host memory (WARM); off: every continuation restores its snapshot file"
        },
    )
    conversation_active_timeout: float = field(
        default=60.0, metadata={"help": "seconds idle before a conversation's engine slot is released (ACTIVE -> WARM)"}
    )
    conversation_warm_timeout: float = field(
        default=1800.0, metadata={"help": "seconds idle before its host copy is dropped (WARM -> COLD, snapshot kept)"}
    )
    conversation_cold_retention: float = field(
        default=0.0, metadata={"help": "seconds idle before a conversation and its snapshots are deleted; 0 keeps them"}
    )
    snapshot_durability: str = field(
        default="sync",
        metadata={
            "help": "sync: answer a turn after its snapshot is on disk; async: write behind, flushed on shutdown",
            "choices": ["sync", "async"],
        },
    )
    shutdown_snapshot_timeout: float = field(
        default=30.0,
        metadata={
            "help": "seconds a graceful shutdown spends writing the states only memory holds (as on leaving it: not under manual_only); 0: none"
        },
    )
    snapshot_preload: int = field(default=0, metadata={"help": "at startup, warm the latest snapshots of the N most recently used conversations"})
    snapshot_health_check_interval: int = field(
        default=1, metadata={"help": "check state norms for anomalies every N turns of a conversation; 0: structural checks only"}
    )
    snapshot_health_failure_policy: str = field(
        default="log_and_continue",
        metadata={"help": "what an anomalous state does", "choices": ["log_and_continue", "skip_snapshot", "refuse_restore"]},
    )
    tool_call_parser: str | None = field(
        default=None,
        metadata={
            "help": "how the model writes tool calls (read into message.tool_calls)",
            "choices": ["hermes", "qwen", "qwen3_coder", "granite", "llama3_json", "mistral"],
        },  # server.tool_parsers.TOOL_PARSERS
    )
    enable_auto_tool_choice: bool = field(default=False, metadata={"help": "allow tool_choice 'auto' (needs --tool-call-parser), as vLLM"})
    reasoning_parser: str | None = field(
        default=None,
        metadata={
            "help": "how the model marks its reasoning (answered as reasoning_content)",
            "choices": ["qwen3", "deepseek_r1", "granite", "nemotron"],
        },  # server.reasoning_parsers.REASONING_PARSERS
    )
    enable_cross_session_refs: bool = field(
        default=True,
        metadata={
            "help": "a new conversation may start from a turn of another the caller owns "
            "(`from_conversation` and `from_turn` on /v1/chat/completions)"
        },
    )

    def __post_init__(self) -> None:
        if isinstance(self.api_key, str):  # ServerArgs(api_key="k"): one key
            self.api_key = [self.api_key]
        if self.pinned_load_memory_gb != 0 and not self.pinned_load_memory_gb * (1 << 30) >= 4096:
            raise ValueError(f"--pinned-load-memory-gb must be 0 (none) or at least 4 KiB, got {self.pinned_load_memory_gb:g}")


_STRATEGY_HERE = (
    "accepted and changes nothing: a turn's whole state (recurrent and attention KV) is captured when "
    "it ends and restored exactly under every value. no_buffer (SGLang: Mamba state kept at request ends) "
    "is how conversation turns work here; extra_buffer (SGLang: state also kept at chunk boundaries, for "
    "prefix reuse) corresponds to --enable-prefix-caching, on by default"
)


@dataclass
class PredecessorArgs:
    """Flags of the SGLang-based predecessor's commands that are accepted here, and what each maps to
    (`apply_predecessor_args`); its flags with no counterpart are refused (`REFUSED_FLAGS`)."""

    mamba_scheduler_strategy: str = field(
        default="auto",
        metadata={
            "help": "the predecessor's (SGLang's) placement of Mamba state for its radix cache: " + _STRATEGY_HERE,
            "choices": ["auto", "no_buffer", "extra_buffer"],
        },
    )
    mamba_radix_cache_strategy: str = field(
        default="auto",
        metadata={
            "help": "SGLang's newer name of --mamba-scheduler-strategy (extra_buffer_lazy: extra_buffer): " + _STRATEGY_HERE,
            "choices": ["auto", "no_buffer", "extra_buffer", "extra_buffer_lazy"],
        },
    )
    disable_radix_cache: bool = field(default=False, metadata={"help": "SGLang's flag: the same as --no-enable-prefix-caching"})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "accepted for SGLang's commands; Engram never runs code from a checkpoint, so there is nothing to trust"}
    )


def apply_predecessor_args(ns: argparse.Namespace) -> None:
    """Translate the accepted predecessor flags into this engine's fields, in place."""
    if ns.disable_radix_cache:
        ns.enable_prefix_caching = False


# The predecessor's flags with no counterpart here, and what to use instead.
REFUSED_FLAGS: dict[str, str] = {
    "snapshot_min_interval_seconds": "snapshots follow turns here, not time: use --snapshot-trigger-policy every_n_turns "
    "with --snapshot-every-n-turns N",
    "snapshot_keep_named_branches": "pruning never removes a branch here: --snapshot-retention-count counts the snapshots of each branch on its own",
    "snapshot_auto_restore": "snapshots are found on first use after a restart; to load some at startup use "
    "--snapshot-preload N (the N most recently used conversations)",
    "enable_tier_background_cleanup": "tier moves always run in the background here (every second), by "
    "--conversation-active-timeout, --conversation-warm-timeout and --conversation-cold-retention",
    "tier_cleanup_interval": "tier moves are checked every second here; set when they happen with "
    "--conversation-active-timeout, --conversation-warm-timeout and --conversation-cold-retention",
    "enable_agent_tools": "there is no built-in agent tool framework: tool calls are the client's",
    "agent_tool_timeout": "there is no built-in agent tool framework: tool calls are the client's",
    "agent_max_iterations": "there is no built-in agent tool framework: tool calls are the client's",
    "agent_max_tool_calls_per_iteration": "there is no built-in agent tool framework: tool calls are the client's",
}


class _Refused(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, **kwargs: typing.Any):
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: typing.Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string} (a flag of the SGLang-based predecessor) is not supported: {REFUSED_FLAGS[self.dest]}")


def add_predecessor_args(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, PredecessorArgs)
    for name in REFUSED_FLAGS:
        parser.add_argument(_flag(name), "--no-" + _flag(name)[2:], dest=name, action=_Refused)
