"""A byte-level tokenizer (ids 0-255 are the bytes) with chat special tokens.

Used by the embedded model and by the tests' random checkpoints; `chat_tokenizer` also wraps the
demo model's BPE tokenizer (scripts/train_demo_model.py). Any UTF-8 text round-trips exactly. The chat template emits nothing after `<|end|>`, so an assistant message renders as
`<|assistant|>` + content + `<|end|>`: exactly what the model produced after the generation
prompt when it stopped at EOS. A conversation can therefore be continued token for token.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|end|>"
ROLES = ("system", "user", "assistant", "tool")
SPECIAL_TOKENS = (PAD, BOS, EOS, *(f"<|{role}|>" for role in ROLES))

# (A newline right after a block tag is written as an expression: templates render with trim_blocks.)
# With `tools`, a hermes-style system section lists them (the first system message's text before
# it) and an assistant message's tool_calls follow its content, each as hermes' <tool_call> JSON.
TOOLS_SECTION = (
    "{% if tools %}<|system|>"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{{ '\n\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|end|>'
    "{% endif %}"
)
TOOL_CALLS = (
    "{% for call in m['tool_calls'] or [] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{% if not loop.first or m['content'] %}{{ '\n' }}{% endif %}"
    '<tool_call>\n{"name": {{ f[\'name\'] | tojson }}, "arguments": '
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}"
)
CHAT_TEMPLATE = (
    TOOLS_SECTION + "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown chat role: ' ~ m['role']) }}"
    "{% endif %}"
    "{% if not (tools and loop.first and m['role'] == 'system') %}"
    "<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}"
    "{% endif %}" + TOOL_CALLS + "<|end|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_byte_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """`vocab_size`: pad the vocabulary to that many ids (special tokens included) with tokens of
    three printable characters, which encoding never produces and each decode to their text: a
    random model's every token then has text (benchmarks stream one chunk per token)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: byte for byte, ch in enumerate(_byte_symbols())}
    printable = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    padding = ("".join(p) for p in itertools.product(printable, repeat=3))
    for token_id in range(len(vocab), (vocab_size or 0) - len(SPECIAL_TOKENS)):
        vocab[next(padding)] = token_id
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return chat_tokenizer(tok)


def chat_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """`tok` (which holds SPECIAL_TOKENS) as a transformers tokenizer with the chat template."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        additional_special_tokens=list(SPECIAL_TOKENS[3:]),
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )


def save_byte_tokenizer(path: str | Path) -> None:
    build_byte_tokenizer().save_pretrained(str(path))


def _byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode map (what the ByteLevel pre-tokenizer emits), indexed by byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    symbols, remapped = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + remapped))
            remapped += 1
    return symbols
