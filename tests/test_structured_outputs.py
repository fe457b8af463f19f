"""Structured outputs (engine/grammar.py): every constrained output follows its schema, regex, grammar
or choices, whatever the sampling; a grammar that allows everything changes nothing; the mask of one
row leaves the others alone."""

from __future__ import annotations

import itertools
import json
import re

import jsonschema
import pytest
from engine_utils import make_engine, run_to_end

from engram.engine.grammar import GrammarError, tokenizer_info
from engram.engine.request import FinishReason, SamplingParams, StructuredOutputsParams

# Short keys and bounded values: each output is some 15-40 tokens of the byte-level vocabulary.
WORD = {"type": "string", "pattern": "^[a-z]{1,4}$"}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"n": {"type": "string", "maxLength": 4}, "a": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["n", "a"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}, "ok": {"type": "boolean"}}, "required": ["c", "ok"]},
    {"type": "object", "properties": {"t": {"type": "array", "items": WORD, "minItems": 1, "maxItems": 2}}, "required": ["t"]},
    {
        "type": "object",
        "properties": {
            "u": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "r": {"enum": ["admin", "guest"]}},
                "required": ["id", "r"],
            }
        },
        "required": ["u"],
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"const": "v"}, "n": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["k", "n"],
        },
        "minItems": 1,
        "maxItems": 2,
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{2}$"},
            "l": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"enum": ["max"]}]},
        },
        "required": ["id", "l"],
    },
    {
        "type": "object",
        "properties": {
            "p": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}] * 2, "items": False},
            "s": {"type": ["string", "null"], "maxLength": 3},
        },
        "required": ["p", "s"],
    },
    {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": WORD}, "required": ["c"]}}, "required": ["b"]}
        },
        "required": ["a"],
    },
]
# (temperature, top_k, top_p, repetition_penalty, frequency_penalty): filters and penalties act after the mask
SAMPLINGS = [
    (0.0, -1, 1.0, 1.0, 0.0),
    (1.0, -1, 1.0, 1.0, 0.0),
    (0.7, 20, 1.0, 1.0, 0.0),
    (1.3, -1, 0.9, 1.0, 0.0),
    (1.0, -1, 1.0, 1.3, 0.0),
    (0.9, 50, 0.95, 1.0, 0.5),
]


@pytest.fixture(scope="module")
def engine(checkpoint_dir):
    return make_engine(checkpoint_dir("mamba2"), max_running_requests=64, max_total_tokens=16384, context_length=1024)


def constrained(max_tokens: int, seed: int | None = None, temperature: float = 1.0, **structured) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, structured_outputs=StructuredOutputsParams(**structured))


def test_200_schema_constrained_requests_parse_and_validate(engine):
    """Batched together with unconstrained requests; seeded and unseeded, greedy and sampled, with
    top-k, top-p and penalties; compact, and (sampled only: a random model's greedy choice can be
    whitespace forever, as any grammar that allows it) with whitespace anywhere."""
    prompts = [engine.tokenizer.encode(text) for text in ("Give JSON: ", "{", "hello", "The answer is")]
    requests = {}
    for i in range(200):
        compact = i >= 10  # the first ten, sampled, start first: their whitespace makes them the longest
        schema = SCHEMAS[i % len(SCHEMAS)] if compact else SCHEMAS[1]
        temperature, top_k, top_p, repetition, frequency = SAMPLINGS[i % len(SAMPLINGS)] if compact else SAMPLINGS[1]
        params = SamplingParams(
            max_tokens=80 if compact else 400,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            repetition_penalty=repetition,
            frequency_penalty=frequency,
            seed=i if i % 3 else None,
            structured_outputs=StructuredOutputsParams(json=schema if i % 2 else json.dumps(schema), disable_any_whitespace=compact),
        )
        requests[f"s{i}"] = schema
        engine.add_request(f"s{i}", prompts[i % len(prompts)], params)
        if i % 25 == 0:
            engine.add_request(f"free{i}", prompts[0], SamplingParams(max_tokens=30, temperature=1.0))
    outputs = run_to_end(engine)
    assert len(outputs) == 208
    for rid, schema in requests.items():
        out = outputs[rid]
        assert out.finish_reason == FinishReason.STOP, (rid, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert sum(bool(re.search(r"\s", outputs[f"s{i}"].text)) for i in range(10)) >= 5  # the free whitespace was used


def test_json_object_gives_an_object(engine):
    prompt = engine.tokenizer.encode("x")
    for i in range(8):
        engine.add_request(f"o{i}", prompt, constrained(60, seed=i, json_object=True, disable_any_whitespace=True))
    outputs = run_to_end(engine).values()
    for out in outputs:
        if out.finish_reason == FinishReason.STOP:  # an object of anything may run to max_tokens
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.text.startswith("{")
    assert any(out.finish_reason == FinishReason.STOP for out in outputs)


def test_a_regex_and_an_ebnf_grammar_always_match(engine):
    regex = r"[a-c]{2,5}-\d{3}( [xyz]+)?"
    ebnf = 'root ::= greeting " " name "!"\ngreeting ::= "hi" | "hello" | "hey"\nname ::= [A-Z] [a-z] [a-z]? [a-z]?'
    same_language = r"(hi|hello|hey) [A-Z][a-z]{1,3}!"
    prompt = engine.tokenizer.encode("say: ")
    for i in range(30):
        temperature = (0.0, 0.8, 1.5)[i % 3]
        engine.add_request(f"re{i}", prompt, constrained(40, seed=i, temperature=temperature, regex=regex))
        engine.add_request(f"gr{i}", prompt, constrained(40, seed=i, temperature=temperature, grammar=ebnf))
    outputs = run_to_end(engine)
    for i in range(30):
        assert re.fullmatch(regex, outputs[f"re{i}"].text), outputs[f"re{i}"].text
        assert re.fullmatch(same_language, outputs[f"gr{i}"].text), outputs[f"gr{i}"].text
        assert outputs[f"re{i}"].finish_reason == outputs[f"gr{i}"].finish_reason == FinishReason.STOP


def test_choices_and_the_end_of_a_grammar(engine):
    """The output is one of the choices (escapes included) and ends there: finish reason stop, the
    EOS that ended it left out of the text, even under ignore_eos."""
    choices = ['say "yes"', "back\\slash", "two\nlines", "ünï", "a"]
    prompt = engine.tokenizer.encode("pick: ")
    for i in range(20):
        params = constrained(30, seed=i, choice=choices)
        params.ignore_eos = i % 2 == 0
        engine.add_request(f"c{i}", prompt, params)
    outputs = run_to_end(engine)
    eos = engine.tokenizer.eos_token_id
    seen = set()
    for out in outputs.values():
        assert out.text in choices and out.finish_reason == FinishReason.STOP
        assert out.token_ids[-1] == eos and out.stop_reason == eos
        seen.add(out.text)
    assert len(seen) > 1


def test_a_grammar_that_allows_all_text_changes_no_greedy_output(engine):
    """Unconstrained greedy outputs equal those under a grammar that allows any text, and rows of a
    batch that mixes the two keep their own outputs. A logit bias (the same in both runs) keeps the
    random model to ASCII, which any text includes (its raw outputs are arbitrary bytes)."""
    vocab = engine.spec.vocab_size
    bias = {t: -100.0 for t in range(128, vocab) if t != engine.tokenizer.eos_token_id}
    prompts = [engine.tokenizer.encode(text) for text in ("hello", "The quick brown fox", "abc", "0123", "{")]

    def greedy(**structured) -> SamplingParams:
        return SamplingParams(
            max_tokens=24, temperature=0.0, logit_bias=bias, structured_outputs=StructuredOutputsParams(**structured) if structured else None
        )

    for i, prompt in enumerate(prompts):
        engine.add_request(f"plain{i}", prompt, greedy())
    plain = run_to_end(engine)  # overlapped steps: nothing constrained
    for i, prompt in enumerate(prompts):
        engine.add_request(f"any{i}", prompt, greedy(regex=r"[\s\S]*"))
        engine.add_request(f"ebnf{i}", prompt, greedy(grammar="root ::= [^]*"))
        engine.add_request(f"mixed{i}", prompt, greedy())
    mixed = run_to_end(engine)
    assert sum(len(out.token_ids) > 10 for out in plain.values()) >= 3
    for i in range(len(prompts)):
        expected = plain[f"plain{i}"].token_ids
        assert all(t < 128 or t == engine.tokenizer.eos_token_id for t in expected)
        assert mixed[f"any{i}"].token_ids == expected
        assert mixed[f"ebnf{i}"].token_ids == expected
        assert mixed[f"mixed{i}"].token_ids == expected


def test_the_mask_forbids_special_and_padding_tokens(engine):
    """Only EOS of the special tokens may end a grammar; ids past the tokenizer are never allowed."""
    tok = engine.tokenizer
    info = tokenizer_info(tok, engine.spec.vocab_size, [tok.eos_token_id])
    vocab = info.decoded_vocab
    assert [vocab[b] for b in range(256)] == [bytes([b]) for b in range(256)]
    assert all(vocab[t] == b"" for t in range(256, engine.spec.vocab_size))
    assert info.stop_token_ids == [tok.eos_token_id]


@pytest.mark.parametrize(
    ("structured", "says"),
    [
        (dict(json={"type": "nonsense"}), 'Unsupported type "nonsense"'),
        (dict(json="{not json"), "not valid JSON"),
        (dict(regex="a(b"), "parenthesis is not closed"),
        (dict(grammar="root ::= missing"), 'Rule "missing" is not defined'),
        (dict(grammar="root ::= ("), "EBNF parser error"),
    ],
)
def test_a_bad_constraint_is_a_value_error_naming_its_source(engine, structured, says):
    params = StructuredOutputsParams(**structured, source="response_format.json_schema.schema")
    with pytest.raises(GrammarError, match=re.escape(says)) as raised:
        engine.compile_grammar(params)
    assert str(raised.value).startswith("response_format.json_schema.schema: ")
    with pytest.raises(ValueError, match=re.escape(says)):  # the engine compiles it itself when not given
        engine.add_request("bad", [1, 2], SamplingParams(structured_outputs=params))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("fields", [dict(), dict(json={}, regex="a"), dict(choice=[]), dict(json_object=False)])
def test_exactly_one_constraint(fields):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**fields)


def test_compiled_grammars_are_cached_by_kind_and_text(engine):
    grammars = engine.grammars
    cache = grammars._compiler.get_cache_size_bytes
    schema = {"type": "object", "properties": {"zz": {"type": "integer"}}}
    for structured in (dict(json=schema), dict(regex="q+[0-9]"), dict(choice=["p", "q"]), dict(grammar='root ::= "w"')):
        before = cache()
        engine.compile_grammar(StructuredOutputsParams(**structured))
        grown = cache()
        assert grown > before
        again = {**structured, "json": json.dumps(schema)} if "json" in structured else structured
        engine.compile_grammar(StructuredOutputsParams(**again, source="elsewhere"))
        assert cache() == grown


def test_a_preempted_constrained_request_keeps_its_grammar(checkpoint_dir):
    """Recomputation after preemption (KV pages run out) feeds the tokens again; the grammar has
    already accepted them and goes on from there."""
    engine = make_engine(checkpoint_dir("granite"), max_running_requests=4, max_total_tokens=160, kv_block_size=16)
    schema = SCHEMAS[3]
    for i in range(4):
        engine.add_request(f"p{i}", engine.tokenizer.encode("go" * 10), constrained(100, seed=i, json=schema, disable_any_whitespace=True))
    outputs = run_to_end(engine)
    assert engine.scheduler.num_preemptions > 0
    for out in outputs.values():
        jsonschema.validate(json.loads(out.text), schema)


def test_choices_from_combinations_are_escaped(engine):
    """Every character class that EBNF strings escape."""
    choices = ["".join(p) for p in itertools.product(['"', "\\", "\t", "x"], repeat=2)]
    prompt = engine.tokenizer.encode("c")
    for i in range(16):
        engine.add_request(f"e{i}", prompt, constrained(10, seed=i, choice=choices))
    assert all(out.text in choices for out in run_to_end(engine).values())


@pytest.mark.parametrize("bound", [{"maxLength": 5}, {"minLength": 1}, {}])
def test_strings_allow_no_raw_control_characters(engine, bound):
    """JSON forbids U+0000-U+001F unescaped; xgrammar's length-bounded strings admit them (mlc-ai/xgrammar#800)."""
    import xgrammar as xgr

    schema = {"type": "object", "properties": {"s": {"type": "string", **bound}}, "required": ["s"]}
    matcher = xgr.GrammarMatcher(engine.compile_grammar(StructuredOutputsParams(json=schema, disable_any_whitespace=True)))
    assert matcher.accept_string('{"s": "')
    bitmask = xgr.allocate_token_bitmask(1, engine.spec.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    allowed = [t for t in range(engine.spec.vocab_size) if bitmask[0, t // 32] >> (t % 32) & 1]
    assert ord("a") in allowed and not [t for t in allowed if t < 0x20]
