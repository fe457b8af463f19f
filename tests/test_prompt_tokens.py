"""A resent chat history is encoded only past the last added token it shares with a recent prompt
(server/prompt_tokens.py), and the ids equal those of encoding the whole prompt."""

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engram.server.prompt_tokens import PromptEncoder, splits_at_added_tokens

DEMO = Path(__file__).resolve().parents[1] / "src" / "engram" / "models" / "demo"
WORDS = "the conversation state is kept exactly and restored so that a turn costs only its new tokens".split()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO)  # a BPE: a split inside a word changes its ids


def whole(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_resent_history_gets_the_ids_of_encoding_it_whole(tokenizer):
    encoder = PromptEncoder(tokenizer, min_chars=1)
    assert encoder.enabled
    messages = [{"role": "system", "content": " ".join(WORDS * 20)}]
    for turn in range(4):
        messages.append({"role": "user", "content": " ".join(WORDS[turn:] * 3)})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert encoder.encode(text) == whole(tokenizer, text)
        # the reply streamed so far, continued next turn: this prompt ends inside a word
        messages.append({"role": "assistant", "content": "the conv"})
        partial = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
        assert encoder.encode(partial) == whole(tokenizer, partial)
        messages[-1] = {"role": "assistant", "content": "the conversation state"}
    assert encoder.reused_chars > 3 * len(messages[0]["content"])  # every turn after the first reused the system prompt at least


def test_a_tokenizer_whose_pieces_depend_on_what_precedes_them_encodes_every_prompt_whole(tokenizer, tmp_path):
    spec = json.loads((DEMO / "tokenizer.json").read_text())
    for token in spec["added_tokens"]:
        token["rstrip"] = True  # `<|end|>` swallows the whitespace after it
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    stripping = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    a, b = "hello<|end|>", "\n  the state"
    assert whole(stripping, a + b) != whole(stripping, a) + whole(stripping, b)  # the law does fail for it
    assert not splits_at_added_tokens(stripping, ["<|end|>"])
    encoder = PromptEncoder(stripping, min_chars=1)
    assert not encoder.enabled
    assert encoder.encode(a + b) == whole(stripping, a + b)


def test_short_prompts_and_tokenizers_without_added_tokens_are_encoded_whole(tokenizer):
    encoder = PromptEncoder(tokenizer)  # min_chars 4096
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert encoder.encode(text) == whole(tokenizer, text) and encoder.encode(text + "x") == whole(tokenizer, text + "x")
    assert encoder.reused_chars == 0
    assert not PromptEncoder(None).enabled
