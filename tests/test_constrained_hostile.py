"""Hostile JSON schemas a tenant's agent may send (engines/rollout/constrained.py): what the grammar
would not enforce, or would take long to build or compile, is refused naming the field; what it
accepts, its grammar enforces (checked with xgrammar's own matcher, no model needed)."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
import xgrammar  # imported before the timed calls

from engines.rollout.constrained import ConstraintError, build_constraint


def json_schema(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def accepts(schema: dict, text: str) -> bool:
    """Whether the grammar built for `schema` accepts `text` as a whole output."""
    from xgrammar.testing import _is_grammar_accept_string

    grammar = xgrammar.Grammar.from_ebnf(build_constraint(json_schema(schema), None, None).grammar)
    return _is_grammar_accept_string(grammar, text)


OPTIONAL = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}}
HOSTILE = [
    # a worker could not parse the grammar: the call was a retried 503 naming the rollout worker
    ({"type": "string", "minLength": -1}, "#.minLength: must be a non-negative integer"),
    ({"type": "object", "$defs": [1]}, "#.$defs: must be an object"),  # was a TypeError
    # accepted, and the grammar's output did not validate against the schema
    ({"type": "object", "properties": {}, "required": ["a"]}, "#.required: 'a' is not among"),
    ({"type": "object", "required": ["a"]}, "#.required: 'a' is not among"),
    ({"type": "string", "pattern": "^[a-z]$", "minLength": 3}, "lengths are not enforced"),
    ({"type": "string", "pattern": "^(?!x).$"}, "lookahead"),
    ({"type": "string", "pattern": "a$b"}, "anchors"),
    # seconds of the endpoint's templating thread, or of the replica's compile, for a few characters
    ({"type": "string", "pattern": "^(abc){0,2000}$"}, "more than 1024 characters"),
    ({"type": "string", "pattern": "^(a{0,1000}){0,1000}$"}, "more than 1024 characters"),
    (OPTIONAL, "#.properties: more than 128 optional properties"),
    ({"type": "string", "pattern": "(" * 2000 + ")" * 2000}, "is not a regular expression"),
    ({"type": "string", "pattern": "^a{4294967296}$"}, "is not a regular expression"),  # was a 500
    ({"type": "string", "pattern": "^a$", "minLength": "3"}, "#.minLength: must be a non-negative"),  # a 500
]  # fmt: skip


@pytest.mark.parametrize(("schema", "says"), HOSTILE, ids=[
    "negative-count", "defs-list", "required-absent", "required-no-properties", "pattern-and-length",
    "lookahead", "inner-anchor", "repeat-group", "nested-repeats", "optional-properties", "deep-groups",
    "count-overflow", "length-not-a-count",
])  # fmt: skip
def test_hostile_schemas_are_refused_at_once_naming_the_field(schema, says):
    start = time.monotonic()
    with pytest.raises(ConstraintError) as refused:
        build_constraint(json_schema(schema), None, None)
    assert refused.value.param == "response_format" and says in str(refused.value), str(refused.value)
    assert time.monotonic() - start < 10  # the grammar's build took 35 s to minutes


def test_a_tools_hostile_parameters_are_refused_naming_that_tool():
    tools = [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": ["x"]}}}]  # fmt: skip
    with pytest.raises(ConstraintError) as refused:
        build_constraint(None, tools, "required")
    assert refused.value.param == "tools[1].function.parameters" and "'x'" in str(refused.value)


SERVED = [
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]},
     ['{"a": 1}', '{"a": 1, "b": "x"}'], ["{}", '{"b": "x"}']),
    ({"type": "string", "pattern": "^[a-z]{2,3}$"}, ['"ab"', '"abc"'], ['"a"', '"abcd"', '"A1"']),
    ({"type": "string", "pattern": "^(ab|cd)+$"}, ['"abcd"'], ['"abc"']),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ['"ab"'], ['"a"', '"abcd"']),
    # lengths the pattern implies (pydantic's constr(pattern=..., max_length=...)); an ECMA named group
    ({"type": "string", "pattern": "^[a-z]{2,3}$", "maxLength": 3}, ['"ab"'], ['"a"', '"abcd"']),
    ({"type": "string", "pattern": "^(?<y>[0-9]{2})-x$"}, ['"12-x"'], ['"1-x"', '"ab-x"']),
    # a long alternation repeats nothing: not refused however long
    ({"type": "string", "pattern": "^(" + "|".join(f"country{i}" for i in range(150)) + ")$"},
     ['"country7"', '"country149"'], ['"country150"', '"countr"']),
]  # fmt: skip


@pytest.mark.parametrize(("schema", "valid", "invalid"), SERVED)
def test_schemas_served_are_enforced_by_their_grammar(schema, valid, invalid):
    # jsonschema reads patterns with Python's re, which names a group (?P<name> where ECMA has (?<name>
    reference = (
        {**schema, "pattern": schema["pattern"].replace("(?<", "(?P<")} if "pattern" in schema else schema
    )
    for text in valid:
        jsonschema.validate(json.loads(text), reference)
        assert accepts(schema, text), text
    for text in invalid:
        assert not accepts(schema, text), text
