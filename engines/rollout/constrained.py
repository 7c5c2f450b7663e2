"""Constrained decoding: what a call's output must match, as one grammar every engine can enforce.

`build_constraint` turns a chat call's `response_format` / `tool_choice` into an xgrammar EBNF
grammar; the hf engine enforces it itself (`GrammarMask`), vLLM through its structured outputs.
xgrammar ignores JSON-schema keywords it does not implement, so schemas are checked here first: an
unenforced keyword, or a schema too big, deep or recursive, is a `ConstraintError` naming the field.
The hf engine's mask sets disallowed logits to -inf before sampling, so the recorded log-probability
is that of the masked, renormalised distribution; it bans special tokens other than the stop tokens
too (xgrammar reads one as its text, which would re-tokenise as the special token).
Imports without torch (the API validates constraints); xgrammar and torch are loaded on first use.
"""

from __future__ import annotations

import graphlib
import hashlib
import json
import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch

try:  # the regex parser's modules are private; Python 3.10 names them otherwise
    from re import _constants as sre
    from re import _parser as sre_parse
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as sre  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

POSSESSIVE_REPEAT = getattr(sre, "POSSESSIVE_REPEAT", None)  # Python 3.11+
ATOMIC_GROUP = getattr(sre, "ATOMIC_GROUP", None)
MAX_SCHEMA_CHARS = 65_536
MAX_SCHEMA_DEPTH = 24
# Compile time grows faster than these: optional properties of one object, a pattern's repeated atoms.
MAX_OPTIONAL_PROPERTIES = 128
MAX_PATTERN_ATOMS = 1024
COUNTS = ("minLength", "maxLength", "minItems", "maxItems")
SEPARATORS = (", ", ": ")  # json.dumps' own, so a constrained call reads back as the template writes it
# The keywords xgrammar turns into grammar rules; annotations constrain nothing and are allowed.
ENFORCED = {
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
    "maxItems", "enum", "const", "anyOf", "$ref", "$defs", "definitions", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern",
}  # fmt: skip
ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly"}  # fmt: skip
TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}
ConstraintKind = Literal["json_object", "json_schema", "tool_call", "json_schema_or_tool_call",
                         "json_object_or_tool_call"]  # fmt: skip


class Constraint(BaseModel):
    """The grammar a completion's tokens must follow (from its first token to its stop token)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: ConstraintKind = Field(..., description="what the grammar stands for")
    grammar: str = Field(..., description="EBNF in xgrammar's dialect (root rule: root)")
    sha256: str = Field(..., description="hash of the grammar text: names the constraint in records")

    def record(self) -> dict[str, str]:
        """How a trajectory states the constraint its sampled tokens were drawn under."""
        return {"kind": self.kind, "grammar_sha256": self.sha256}


class ConstraintError(ValueError):
    """A constraint that cannot be enforced; `param` names the request field that asked for it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def check_schema(schema: Any, param: str) -> dict[str, Any]:
    """`schema` when every keyword is enforced and it is small and not recursive; else ConstraintError."""
    if not isinstance(schema, dict):
        raise ConstraintError(param, f"the JSON schema must be an object, got {type(schema).__name__}")
    try:
        size = len(json.dumps(schema))
    except (TypeError, ValueError, RecursionError) as err:
        raise ConstraintError(param, f"the JSON schema is not JSON: {err}") from None
    if size > MAX_SCHEMA_CHARS:
        raise ConstraintError(param, f"the JSON schema has {size} characters; at most {MAX_SCHEMA_CHARS}")
    _walk(schema, param, "#", 0)
    definitions = {**(schema.get("$defs") or {}), **(schema.get("definitions") or {})}
    _refuse_cycles(schema, definitions, param)
    return schema


def _walk(node: Any, param: str, at: str, depth: int) -> None:
    if isinstance(node, bool):
        return  # true / false: anything / nothing
    if not isinstance(node, dict):
        raise ConstraintError(param, f"{at}: a schema must be an object or a boolean")
    if depth > MAX_SCHEMA_DEPTH:
        raise ConstraintError(param, f"{at}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    _check_object(node, param, at)
    for key, value in node.items():
        if key in ANNOTATIONS:
            continue
        if key not in ENFORCED:
            raise ConstraintError(param, f"{at}: keyword '{key}' is not enforced by constrained decoding; "
                                  f"use only {', '.join(sorted(ENFORCED))}")  # fmt: skip
        if key == "type":
            kinds = value if isinstance(value, list) else [value]
            if not kinds or any(k not in TYPES for k in kinds):
                raise ConstraintError(param, f"{at}.type: {json.dumps(value)} is not one of {sorted(TYPES)}")
        elif key in ("properties", "$defs", "definitions"):
            if not isinstance(value, dict):
                raise ConstraintError(param, f"{at}.{key}: must be an object")
            for name, sub in value.items():
                _walk(sub, param, f"{at}.{key}.{name}", depth + 1)
        elif key in ("items", "additionalProperties"):
            _walk(value, param, f"{at}.{key}", depth + 1)
        elif key in ("anyOf", "prefixItems"):
            if not isinstance(value, list) or not value:
                raise ConstraintError(param, f"{at}.{key}: must be a non-empty list of schemas")
            for k, sub in enumerate(value):
                _walk(sub, param, f"{at}.{key}[{k}]", depth + 1)
        elif key in COUNTS and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ConstraintError(
                param, f"{at}.{key}: must be a non-negative integer, got {json.dumps(value)}"
            )
        elif key == "pattern":
            _check_pattern(value, node, param, f"{at}.pattern")
        elif key == "$ref" and not (
            isinstance(value, str) and value.startswith(("#/$defs/", "#/definitions/"))
        ):
            raise ConstraintError(
                param, f"{at}.$ref: only references into '#/$defs/' or '#/definitions/' are served"
            )


def _check_object(node: dict[str, Any], param: str, at: str) -> None:
    """xgrammar answers `{}` for a required property it may not write, and builds rules for each
    ordering of optional ones."""
    properties, required = node.get("properties") or {}, node.get("required", [])
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        raise ConstraintError(param, f"{at}.required: must be a list of property names")
    if isinstance(properties, dict) and (missing := [n for n in required if n not in properties]):
        raise ConstraintError(param, f"{at}.required: '{missing[0]}' is not among the object's properties")
    if isinstance(properties, dict) and len(set(properties) - set(required)) > MAX_OPTIONAL_PROPERTIES:
        raise ConstraintError(param, f"{at}.properties: more than {MAX_OPTIONAL_PROPERTIES} optional "
                              "properties; list more of them in 'required'")  # fmt: skip


def _check_pattern(pattern: Any, node: dict[str, Any], param: str, at: str) -> None:
    """xgrammar drops lookarounds, inner anchors and a pattern's length bounds, and expands counted
    repeats: what it would not enforce, or would take long to compile, is refused."""
    if not isinstance(pattern, str):
        raise ConstraintError(param, f"{at}: must be a string")
    # JSON Schema's regexes are ECMA-262's: a named group is `(?<name>`, Python's `(?P<name>`
    read = re.sub(r"\(\?<(?![=!])", "(?P<", pattern)
    try:
        items = sre_parse.parse(read)
        width = items.getwidth()
    except (re.error, RecursionError, OverflowError, ValueError) as err:  # a count past 2**32: OverflowError
        raise ConstraintError(param, f"{at}: {json.dumps(pattern)[:200]} is not a regular expression "
                              f"constrained decoding serves: {err}") from None  # fmt: skip
    try:
        atoms, plain = _atoms(list(items), param, at, True, True), _atoms(list(items), param, at, True, False)
    except RecursionError:
        raise ConstraintError(param, f"{at}: the pattern nests too deeply") from None
    if atoms - plain > MAX_PATTERN_ATOMS:
        raise ConstraintError(param, f"{at}: its counted repeats expand it by more than {MAX_PATTERN_ATOMS} "
                              "characters")  # fmt: skip
    # The grammar writes a string the whole pattern matches and drops the lengths: they hold only when
    # every such string has them already.
    low, high = node.get("minLength", 0), node.get("maxLength")
    if not all(isinstance(n, int) for n in (low, 0 if high is None else high)):
        return  # not counts: refused naming them where the walk reaches them
    if ("minLength" in node or "maxLength" in node) and not (
        width[0] >= low and (high is None or width[1] <= high)
    ):
        raise ConstraintError(param, f"{at}: with minLength / maxLength the lengths are not enforced; "
                              "write them into the pattern ('^[a-z]{1,20}$')")  # fmt: skip


def _atoms(items: list[tuple[Any, Any]], param: str, at: str, top: bool, expand: bool) -> int:
    """How many characters the pattern's counted repeats expand to (`expand`; an unbounded repeat
    counts once), or its items counted once each."""
    total = 0
    for k, (op, arg) in enumerate(items):
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, POSSESSIVE_REPEAT):
            low, high, sub = arg
            times = max(low if high == sre.MAXREPEAT else high, 1) if expand else 1
            total += times * _atoms(list(sub), param, at, False, expand)
        elif op in (sre.SUBPATTERN, ATOMIC_GROUP):
            inner = arg[-1] if op == sre.SUBPATTERN else arg
            total += _atoms(list(inner), param, at, top and len(items) == 1, expand)
        elif op == sre.BRANCH:
            total += sum(_atoms(list(sub), param, at, top and len(items) == 1, expand) for sub in arg[1])
        elif op in (sre.ASSERT, sre.ASSERT_NOT):
            raise ConstraintError(
                param, f"{at}: lookahead and lookbehind are not enforced by constrained decoding"
            )
        elif op == sre.AT and not (top and (k == 0 or k == len(items) - 1)):
            raise ConstraintError(param, f"{at}: anchors are enforced only at the pattern's start and end")
        else:
            total += 1
    return total


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"].rsplit("/", 1)[-1]} if isinstance(node.get("$ref"), str) else set()
        for key, value in node.items():
            if key not in ("$defs", "definitions"):
                found |= _refs(value)
        return found
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node)) if node else set()
    return set()


def _refuse_cycles(schema: dict[str, Any], definitions: dict[str, Any], param: str) -> None:
    """A recursive schema has no bounded grammar: a definition that reaches itself is refused."""
    edges = {name: _refs(body) for name, body in definitions.items()}
    for name in _refs(schema) | set(edges):
        if name not in edges:
            raise ConstraintError(param, f"$ref to '{name}', which the schema does not define")
    try:
        graphlib.TopologicalSorter(edges).prepare()
    except graphlib.CycleError as cycle:
        raise ConstraintError(
            param, f"definition '{cycle.args[1][0]}' refers to itself: recursive schemas are not served"
        ) from None


def _grammar_of_schema(schema: dict[str, Any], param: str, strict: bool = True) -> Any:
    import xgrammar

    try:
        return xgrammar.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=False, separators=SEPARATORS, strict_mode=strict
        )
    except (RuntimeError, ValueError) as err:
        raise ConstraintError(
            param, f"the JSON schema could not be turned into a grammar: {err}".strip()
        ) from None


def _tool_call_grammar(tools: list[dict[str, Any]], name: str | None) -> Any:
    """`<tool_call>{"name": <one of the tools, or `name`>, "arguments": <its parameters>}</tool_call>`."""
    import xgrammar

    calls = []
    for i, tool in enumerate(tools):
        function = tool.get("function") or {}
        if name is not None and function.get("name") != name:
            continue
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        where = f"tools[{i}].function.parameters"
        check_schema(parameters, where)
        calls.append({"type": "object", "properties": {"name": {"const": function.get("name")},
                      "arguments": parameters}, "required": ["name", "arguments"],
                      "additionalProperties": False})  # fmt: skip
    if not calls:
        raise ConstraintError(
            "tool_choice", f"names the function '{name}', which is not among the request's tools"
        )
    body = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return xgrammar.Grammar.concat(
        xgrammar.Grammar.from_ebnf('root ::= "<tool_call>"'),
        _grammar_of_schema(body, "tool_choice"),
        xgrammar.Grammar.from_ebnf('root ::= "</tool_call>"'),
    )


def _format_grammar(response_format: dict[str, Any] | None, param: str) -> tuple[str | None, Any]:
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None, None
    if kind == "json_object":
        return kind, _grammar_of_schema({"type": "object"}, param, strict=False)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ConstraintError(param, "json_schema needs {'name': ..., 'schema': {...}}")
        return kind, _grammar_of_schema(check_schema(spec["schema"], param), param)
    raise ConstraintError(param, f"type '{kind}' is not one of text, json_object, json_schema")


def forced_tool(tool_choice: Any, tools: list[dict[str, Any]] | None) -> tuple[bool, str | None]:
    """(whether the call must be a tool call, the function it must call or None for any)."""
    if tool_choice in (None, "auto", "none"):
        return False, None
    if tool_choice == "required":
        name = None
    elif isinstance(tool_choice, dict) and isinstance((tool_choice.get("function") or {}).get("name"), str):
        name = tool_choice["function"]["name"]
    else:
        raise ConstraintError("tool_choice", f"{json.dumps(tool_choice)[:200]} is not 'none', 'auto', 'required' "
                              "or {'type': 'function', 'function': {'name': ...}}")  # fmt: skip
    if not tools:
        raise ConstraintError(
            "tool_choice", f"{json.dumps(tool_choice)[:200]} forces a tool call, but the request has no tools"
        )
    return True, name


def build_constraint(
    response_format: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    format_param: str = "response_format",
) -> Constraint | None:
    """The grammar a chat call's output must follow, or None for free text. A forced tool call is the
    whole output; with tools offered ("auto") and a format, either the format or one tool call."""
    import xgrammar

    forced, name = forced_tool(tool_choice, tools)
    kind, form = _format_grammar(response_format, format_param)
    if forced:
        kind, grammar = "tool_call", _tool_call_grammar(tools or [], name)
    elif form is None:
        return None
    elif tools and tool_choice != "none":
        kind, grammar = f"{kind}_or_tool_call", xgrammar.Grammar.union(form, _tool_call_grammar(tools, None))
    else:
        grammar = form
    text = str(grammar)
    return Constraint(kind=kind, grammar=text, sha256=hashlib.sha256(text.encode()).hexdigest())


# ---- the hf engine's enforcement: one xgrammar matcher per row, a token mask per step ----


class GrammarCompilers:
    """xgrammar compilers for one model's tokenizer, one per set of stop tokens, built on first use."""

    def __init__(self, model_path: str | Path, vocab_size: int) -> None:
        self.model_path, self.vocab_size = str(model_path), vocab_size
        self._compilers: dict[tuple[int, ...], Any] = {}
        self._tokenizer: Any = None

    def banned_ids(self, stop_ids: list[int]) -> list[int]:
        """The special tokens a constrained completion never holds."""
        return sorted(set(self._load_tokenizer().all_special_ids) - set(stop_ids))

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer

    def compiled(self, constraint: Constraint, stop_ids: list[int]) -> Any:
        import xgrammar

        stops = tuple(sorted(stop_ids))
        if stops not in self._compilers:
            info = xgrammar.TokenizerInfo.from_huggingface(
                self._load_tokenizer(), vocab_size=self.vocab_size, stop_token_ids=list(stops)
            )
            self._compilers[stops] = lru_cache(maxsize=64)(xgrammar.GrammarCompiler(info).compile_grammar)
        return self._compilers[stops](constraint.grammar)


class GrammarMask:
    """The matchers of one generate call's rows (indexed by original row)."""

    def __init__(self, compiled: Any, rows: int, vocab_size: int, banned_ids: list[int]) -> None:
        import torch
        import xgrammar

        self.banned = torch.tensor(banned_ids, dtype=torch.long)
        self._xgr = xgrammar
        self.matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(rows)]
        self.vocab_size = vocab_size
        self.bitmask = xgrammar.allocate_token_bitmask(rows, vocab_size)

    def apply(self, logits: torch.Tensor, live: torch.Tensor, done: torch.Tensor) -> None:
        """Set to -inf, in place, the logits [B, V] of tokens the rows' grammars do not allow next."""
        bitmask = self.bitmask[: len(live)]
        bitmask.fill_(-1)  # all allowed: finished rows are fed pad and their outputs ignored
        for i, (row, finished) in enumerate(zip(live.tolist(), done.tolist(), strict=True)):
            if not finished:
                self.matchers[row].fill_next_token_bitmask(bitmask, i)
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size)
        logits[:, self.banned.to(logits.device)] = float("-inf")

    def accept(self, tokens: torch.Tensor, live: torch.Tensor, done: torch.Tensor) -> None:
        """Advance each decoding row's matcher by its sampled token."""
        for row, token, finished in zip(live.tolist(), tokens.tolist(), done.tolist(), strict=True):
            if not finished and not self.matchers[row].accept_token(token):
                raise RuntimeError(f"row {row}'s grammar refused token {token}, which its mask allowed")
