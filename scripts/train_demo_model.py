"""Train the demo model: a tiny Granite-4.0-H-style hybrid on Python's standard-library sources.

    python scripts/train_demo_model.py --out DIR [--minutes 5] [--steps N] [--seed 0]

Corpus: every .py file under sysconfig's stdlib folder (site-packages left out) that decodes as
UTF-8; a file is held out when the SHA-256 of its path inside that folder says so (about 1 in
40), so the split does not depend on the files' contents or order. Tokenizer: byte-level BPE
(`tokenizers`) trained on the training files, with engram's chat special tokens and template
(every byte is a token, so any input encodes and round-trips). Model: transformers'
GraniteMoeHybridForCausalLM from a config (3 Mamba2 layers and one attention layer, dense MLPs),
trained with AdamW, warm-up then cosine decay, bf16 autocast on CUDA. Half of each batch is
windows of the plain files, half chat-rendered functions (the user turn a signature and
docstring, the assistant turn the body, a file's functions one turn after another), so the
model continues code both in /v1/completions and in a chat.

`--minutes` bounds the whole run (the tokenizer, both evaluations and the save included); the
schedule then follows the elapsed time, so the step count depends on the machine's speed. It is
printed and written to training.json: `--steps N` repeats a run step for step (the seed fixes
the initialization and every batch). The output folder is an ordinary checkpoint
(save_pretrained), with the weights in bfloat16 (`--save-dtype`).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # engram from this tree, installed or not

from engram.models.byte_tokenizer import EOS, SPECIAL_TOKENS, chat_tokenizer  # noqa: E402
from engram.models.embedded import hybrid_config, save_checkpoint  # noqa: E402

HELDOUT_ONE_IN = 40
MAX_WEIGHT_BYTES = 8_000_000


@dataclass
class Corpus:
    root: str
    train: list[str]  # file texts, sorted by their path's hash
    heldout: list[str]
    train_bytes: int
    heldout_bytes: int


@dataclass
class Streams:
    plain: torch.Tensor  # the training files' tokens, each file followed by EOS
    chat: torch.Tensor  # chat-rendered functions
    chat_starts: torch.Tensor  # positions of the user tokens in `chat`: chat windows start there
    heldout: torch.Tensor  # the held-out files, as `plain`


def read_corpus(max_files: int | None) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[tuple[str, str]] = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if {"site-packages", "dist-packages"} & set(path.relative_to(root).parts) or not path.is_file():
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:  # a few test files are deliberately in other encodings
            continue
        if text.strip():  # not the empty __init__.py files
            files.append((hashlib.sha256(rel.encode()).hexdigest(), text))
    files.sort()
    train = [text for digest, text in files if int(digest[:8], 16) % HELDOUT_ONE_IN]
    heldout = [text for digest, text in files if not int(digest[:8], 16) % HELDOUT_ONE_IN]
    if max_files is not None:
        train, heldout = train[:max_files], heldout[: max(1, max_files // 10)]
    size = lambda texts: sum(len(t.encode()) for t in texts)  # noqa: E731
    return Corpus(str(root), train, heldout, size(train), size(heldout))


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return chat_tokenizer(tok)


def function_turns(text: str) -> list[dict[str, str]]:
    """A file's functions as chat messages: the signature (and docstring) from the user, the body
    from the assistant, dedented to the def line; in source order."""
    try:
        with warnings.catch_warnings():  # Python 3.12 warns of the stdlib's few invalid escapes, once per file
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    lines = text.splitlines()
    messages = []
    defs = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    for node in sorted(defs, key=lambda n: n.lineno):
        first = node.body[0]
        has_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
        header_end = first.end_lineno if has_doc else first.lineno - 1  # 1-based, inclusive
        if header_end is None or header_end < node.lineno or node.end_lineno is None or node.end_lineno <= header_end:
            continue  # a one-line def, or a body that is only its docstring
        indent = node.col_offset
        block = [line[indent:] if not line[:indent].strip() else line.lstrip() for line in lines[node.lineno - 1 : node.end_lineno]]
        split = header_end - node.lineno + 1
        messages.append({"role": "user", "content": "\n".join(block[:split])})
        messages.append({"role": "assistant", "content": "\n".join(block[split:])})
    return messages


def build_streams(tokenizer, corpus: Corpus) -> Streams:
    backend = tokenizer.backend_tokenizer
    eos = tokenizer.convert_tokens_to_ids(EOS)
    user = tokenizer.convert_tokens_to_ids("<|user|>")

    def plain(texts: list[str]) -> torch.Tensor:
        ids: list[int] = []
        for enc in backend.encode_batch(texts, add_special_tokens=False):
            ids += enc.ids
            ids.append(eos)
        return torch.tensor(ids, dtype=torch.long)

    conversations = [turns for turns in map(function_turns, corpus.train) if turns]
    rendered = [tokenizer.apply_chat_template(turns, tokenize=False) for turns in conversations]
    chat = torch.tensor([i for enc in backend.encode_batch(rendered, add_special_tokens=False) for i in enc.ids], dtype=torch.long)
    return Streams(plain(corpus.train), chat, (chat == user).nonzero().flatten(), plain(corpus.heldout))


def demo_config(tokenizer):
    """3 Mamba2 layers and one attention layer (no positional encoding, as in Granite 4.0-H) of
    width 256, dense MLPs: 3.9M parameters with a 4096-token vocabulary, 7.8 MB in bfloat16."""
    head_dim = 64
    return hybrid_config(
        tokenizer,
        hidden_size=256,
        num_hidden_layers=4,
        layer_types=["mamba", "mamba", "attention", "mamba"],
        max_position_embeddings=8192,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_multiplier=1 / math.sqrt(head_dim),
        mamba_n_heads=8,
        mamba_d_head=64,
        mamba_d_state=64,
        mamba_chunk_size=64,
        # intermediate_size is read only with experts: kept equal, so that nothing sizes for its default of 11008
        num_local_experts=0,
        shared_intermediate_size=448,
        intermediate_size=448,
    )


def sample_batch(streams: Streams, batch: int, seq_len: int, chat_fraction: float, g: torch.Generator) -> torch.Tensor:
    """`batch` windows of seq_len + 1 tokens: plain ones anywhere, chat ones from a user turn."""
    n_chat = round(batch * chat_fraction) if len(streams.chat) > seq_len + 1 else 0
    plain = torch.randint(0, len(streams.plain) - seq_len - 1, (batch - n_chat,), generator=g)
    usable = streams.chat_starts[streams.chat_starts < len(streams.chat) - seq_len - 1]
    chat = usable[torch.randint(0, max(len(usable), 1), (n_chat,), generator=g)] if n_chat else plain[:0]
    span = torch.arange(seq_len + 1)
    return torch.cat([streams.plain[plain[:, None] + span], streams.chat[chat[:, None] + span]])


def loss_of(model, window: torch.Tensor, device: torch.device) -> torch.Tensor:
    window = window.to(device, non_blocking=True)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=window[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())


@torch.no_grad()
def evaluate(model, tokens: torch.Tensor, token_bytes: torch.Tensor, seq_len: int, max_tokens: int, device: torch.device) -> dict[str, float]:
    """Perplexity per token and bits per byte of text, over non-overlapping windows."""
    model.eval()
    seq_len = min(seq_len, len(tokens) - 1)  # a smoke run's held-out files may be short
    n = min(len(tokens) - 1, max_tokens) // seq_len
    windows = tokens[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)
    nll = 0.0
    for chunk in windows.split(16):
        nll += loss_of(model, chunk, device).item() * chunk.shape[0] * seq_len
    model.train()
    count = n * seq_len
    covered = int(token_bytes[windows[:, 1:]].sum())
    return {"tokens": count, "perplexity": math.exp(nll / count), "bits_per_byte": nll / math.log(2) / covered}


def byte_lengths(tokenizer, vocab_size: int) -> torch.Tensor:
    """Bytes of text per id: one per character of a byte-level token, none for special tokens."""
    lengths = torch.zeros(vocab_size, dtype=torch.long)
    for token, i in tokenizer.get_vocab().items():
        lengths[i] = 0 if token in SPECIAL_TOKENS else len(token)
    return lengths


def lr_factor(progress: float, step: int, warmup_steps: int) -> float:
    return min(1.0, (step + 1) / warmup_steps) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def make_optimizer(model, lr: float, weight_decay: float, device: torch.device) -> torch.optim.Optimizer:
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]  # norms, biases, A_log, D, dt_bias
    groups = [{"params": matrices, "weight_decay": weight_decay}, {"params": others, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="checkpoint folder to write")
    parser.add_argument("--minutes", type=float, default=5.0, help="time budget of the whole run (default: 5)")
    parser.add_argument("--steps", type=int, default=None, help="train exactly this many steps (within --minutes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--chat-fraction", type=float, default=0.5, help="share of each batch from chat-rendered functions")
    parser.add_argument("--eval-tokens", type=int, default=262144, help="held-out tokens evaluated (at most)")
    parser.add_argument("--max-files", type=int, default=None, help="train on this many files only (smoke runs)")
    parser.add_argument("--device", default="auto", help="auto|cpu|cuda")
    parser.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    deadline = start + args.minutes * 60
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    torch.manual_seed(args.seed)

    from transformers import GraniteMoeHybridForCausalLM

    corpus = read_corpus(args.max_files)
    print(
        f"corpus: {corpus.root}: {len(corpus.train)} files ({corpus.train_bytes / 1e6:.1f} MB) to train on, "
        f"{len(corpus.heldout)} held out ({corpus.heldout_bytes / 1e6:.2f} MB)",
        flush=True,
    )
    tokenizer = train_tokenizer(corpus.train, args.vocab_size)
    streams = build_streams(tokenizer, corpus)
    print(
        f"tokenizer: {len(tokenizer)} tokens; {len(streams.plain):,} training tokens "
        f"({corpus.train_bytes / len(streams.plain):.2f} bytes each), {len(streams.chat):,} in chat-rendered functions, "
        f"{len(streams.heldout):,} held out ({time.monotonic() - start:.0f} s)",
        flush=True,
    )

    model = GraniteMoeHybridForCausalLM(demo_config(tokenizer))
    model.to(device=device)
    vocab_size = model.config.vocab_size
    weight_bytes = sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=getattr(torch, args.save_dtype)).element_size()
    if weight_bytes > MAX_WEIGHT_BYTES:
        raise SystemExit(f"the model's weights take {weight_bytes:,} bytes in {args.save_dtype}, over {MAX_WEIGHT_BYTES:,}")
    token_bytes = byte_lengths(tokenizer, vocab_size)
    eval_started = time.monotonic()
    untrained = evaluate(model, streams.heldout, token_bytes, args.seq_len, args.eval_tokens, device)
    eval_seconds = time.monotonic() - eval_started
    print(
        f"untrained: held-out perplexity {untrained['perplexity']:.1f} ({untrained['bits_per_byte']:.3f} bits/byte, "
        f"{untrained['tokens']:,} tokens, {eval_seconds:.1f} s)",
        flush=True,
    )

    optimizer = make_optimizer(model, args.lr, args.weight_decay, device)
    g = torch.Generator().manual_seed(args.seed)
    train_started = time.monotonic()
    train_end = deadline - 2 * eval_seconds - 10  # the final evaluation and the save
    step = 0
    while (args.steps is None or step < args.steps) and (step == 0 or time.monotonic() < train_end):
        progress = step / args.steps if args.steps else (time.monotonic() - train_started) / max(train_end - train_started, 1e-9)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_factor(progress, step, args.warmup_steps)
        batch_loss = loss_of(model, sample_batch(streams, args.batch_size, args.seq_len, args.chat_fraction, g), device)
        optimizer.zero_grad(set_to_none=True)
        batch_loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 100 == 0 or step == args.steps:
            elapsed = time.monotonic() - train_started
            print(
                f"step {step}: loss {batch_loss.item():.3f}, lr {optimizer.param_groups[0]['lr']:.2e}, {elapsed:.0f} s, "
                f"{step * args.batch_size * args.seq_len / elapsed:,.0f} tokens/s",
                flush=True,
            )
    train_seconds = time.monotonic() - train_started
    trained = evaluate(model, streams.heldout, token_bytes, args.seq_len, args.eval_tokens, device)
    tokens_seen = step * args.batch_size * args.seq_len
    print(
        f"trained: {step} steps, {tokens_seen:,} tokens ({tokens_seen / len(streams.plain):.1f} x the plain corpus) "
        f"in {train_seconds:.0f} s; held-out perplexity {trained['perplexity']:.2f} ({trained['bits_per_byte']:.3f} bits/byte)",
        flush=True,
    )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.to(device="cpu", dtype=getattr(torch, args.save_dtype))
    model.config.dtype = args.save_dtype
    save_checkpoint(model, tokenizer, out)
    record = {
        "corpus": {
            "source": "Python standard library (.py files), PSF license",
            "python": platform.python_version(),
            "train_files": len(corpus.train),
            "heldout_files": len(corpus.heldout),
            "train_bytes": corpus.train_bytes,
            "heldout_bytes": corpus.heldout_bytes,
            "heldout_rule": f"int(sha256(path in the stdlib folder)[:8 hex digits]) % {HELDOUT_ONE_IN} == 0",
        },
        "tokenizer": {"vocab": len(tokenizer), "train_tokens": len(streams.plain), "chat_tokens": len(streams.chat)},
        "model": {"parameters": sum(p.numel() for p in model.parameters()), "weight_bytes": weight_bytes, "dtype": args.save_dtype},
        "training": {
            "steps": step,
            "tokens": tokens_seen,
            "seconds": round(train_seconds, 1),
            "device": str(device),
            "torch": torch.__version__,
            "args": {k: v for k, v in vars(args).items() if k != "out"},
        },
        "heldout": {"untrained": untrained, "trained": trained},
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out} ({time.monotonic() - start:.0f} s in all); repeat this run with --steps {step}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
