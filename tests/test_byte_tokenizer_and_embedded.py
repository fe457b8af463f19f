from __future__ import annotations

import pytest
import torch

from engram.models.byte_tokenizer import EOS, SPECIAL_TOKENS, build_byte_tokenizer, save_byte_tokenizer
from engram.models.embedded import EMBEDDED_MODEL_NAME, ensure_embedded_model
from engram.models.spec import load_model_spec

TEXTS = [
    "",
    "hello world",
    " leading and trailing spaces  ",
    "héllo wörld — ñ, 世界, 🤖🦀, e\u0301, \u200b zero-width",
    "tabs\tnewlines\n\r\nnull\x00 del\x7f",
    "<|user|> looks special <|end|>",
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    save_byte_tokenizer(path)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


@pytest.fixture(params=["byte", "demo"])
def template_tokenizer(request, saved_tokenizer):
    """The byte tokenizer as saved, and the demo model's BPE tokenizer (a smoke run's): both carry the chat template."""
    if request.param == "byte":
        return saved_tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(request.getfixturevalue("demo_checkpoint")[0], local_files_only=True)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tokenizer, saved_tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert saved_tokenizer.encode(text) == ids
    assert saved_tokenizer.decode(ids) == text


def test_bytes_are_ids_and_no_bos(tokenizer):
    assert tokenizer.encode("Az\n") == [ord("A"), ord("z"), ord("\n")]
    assert tokenizer.encode("é") == list("é".encode())


def test_special_tokens(tokenizer, saved_tokenizer):
    for tok in (tokenizer, saved_tokenizer):
        ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
        assert ids == list(range(256, 256 + len(SPECIAL_TOKENS)))
        for t, i in zip(SPECIAL_TOKENS, ids):
            assert tok.encode(t) == [i]
        assert tok.eos_token == EOS and tok.eos_token_id == 258
        assert tok.pad_token_id == 256 and tok.bos_token_id == 257
        assert len(tok) == 263


def _render(tok, messages, **kw) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


def test_chat_template_continues_token_exactly(template_tokenizer):
    tok = template_tokenizer
    sys_msg = {"role": "system", "content": "Be brief."}
    u1 = {"role": "user", "content": "Hi, ça va? "}
    a1 = {"role": "assistant", "content": " Oui.\n"}
    u2 = {"role": "user", "content": "Et toi?"}
    prompt = _render(tok, [sys_msg, u1], add_generation_prompt=True)
    generated = tok.encode(a1["content"]) + [tok.eos_token_id]
    assert _render(tok, [sys_msg, u1, a1]) == prompt + generated
    full = _render(tok, [sys_msg, u1, a1, u2], add_generation_prompt=True)
    assert full[: len(prompt) + len(generated)] == prompt + generated
    text = tok.apply_chat_template([u1], tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>Hi, ça va? <|end|><|assistant|>"


def test_chat_template_content_parts_and_bad_role(template_tokenizer):
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert template_tokenizer.apply_chat_template([parts], tokenize=False) == "<|user|>ab<|end|>"
    with pytest.raises(Exception, match="unknown chat role"):
        template_tokenizer.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_embedded_model_is_deterministic_and_reused(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first = ensure_embedded_model(tmp_path / "a")
    second = ensure_embedded_model(str(tmp_path / "b"))
    assert first.name == second.name == "embedded-hybrid-v2"
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["embedded-hybrid-v2"]  # no temp leftovers

    mtime = (first / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setenv("ENGRAM_CACHE_DIR", str(tmp_path / "a"))
    assert ensure_embedded_model() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime

    spec = load_model_spec(first)
    assert spec.model_type == "granitemoehybrid" and spec.is_hybrid
    assert spec.layout() == ["mamba", "attention", "mamba", "mamba"]
    assert spec.eos_token_ids == (258,)
    assert spec.vocab_size % 8 == 0 and spec.vocab_size >= 263 and spec.tie_word_embeddings

    tok = AutoTokenizer.from_pretrained(first, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(first, local_files_only=True).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), spec.vocab_size)
    assert torch.isfinite(logits).all()
    assert EMBEDDED_MODEL_NAME == "engram-embedded-hybrid"


def test_embedded_model_lost_race_keeps_winner(tmp_path, monkeypatch):
    import engram.models.embedded as embedded

    target = tmp_path / "embedded-hybrid-v2"

    def write_while_another_process_wins(path):
        (path / "config.json").write_text("loser")
        target.mkdir()
        (target / "config.json").write_text("winner")

    monkeypatch.setattr(embedded, "_write_embedded_model", write_while_another_process_wins)
    assert ensure_embedded_model(tmp_path) == target
    assert (target / "config.json").read_text() == "winner"
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_embedded_model_crash_leaves_nothing(tmp_path, monkeypatch):
    import engram.models.embedded as embedded

    def crash(path):
        (path / "config.json").write_text("partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(embedded, "_write_embedded_model", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_embedded_model(tmp_path)
    assert list(tmp_path.iterdir()) == []
