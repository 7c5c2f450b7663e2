"""The sglang adapter checked against the source of the sglang release it targets.

sglang needs CUDA and cannot run here, so `make install` puts that release's files (pip install
--no-deps --target, not importable) under <venv>/sglang-source and these tests read them with
`ast`, never importing them. The adapter is driven against a recorder standing in for sglang's
Engine; every call it records must name a method the real Engine has, with parameters that method
(or, for the constructor, ServerArgs) accepts. The output dicts and finish reasons the adapter
parses are read off the real code that builds them. A rename upstream fails here, not in a job.
"""

from __future__ import annotations

import ast
import re
import sys
import types
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.rollout import SGLANG_VERSION
from engines.rollout.base import RolloutEngineError, SamplingParams
from engines.rollout.sglang import SGLangRolloutEngine, finish_reason_from_sglang

REPO = Path(__file__).resolve().parents[1]
SOURCE = Path(sys.prefix) / "sglang-source"


# ---- reading the release ----------------------------------------------------------------------


@cache
def parse(relative: str) -> ast.Module:
    path = SOURCE / "sglang" / relative
    if not path.exists():
        pytest.fail(f"sglang {SGLANG_VERSION} source is missing at {SOURCE}: run `make install`")
    return ast.parse(path.read_text(), filename=str(path))


def find_class(tree: ast.Module, name: str) -> ast.ClassDef:
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"sglang {SGLANG_VERSION} has no class {name}"
    return found[0]


def class_fields(cls: ast.ClassDef) -> set[str]:
    """Names annotated in a class body (dataclass / msgspec.Struct fields)."""
    return {
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and not n.target.id.startswith("_")
    }


@dataclass(frozen=True)
class Signature:
    params: tuple[str, ...]  # positional-or-keyword then keyword-only, without self
    positional: int
    var_keyword: bool


def method_signature(cls: ast.ClassDef, name: str) -> Signature:
    methods = [
        n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
    ]
    assert methods, f"sglang {SGLANG_VERSION}: {cls.name} has no method {name}"
    args = methods[0].args
    positional = [a.arg for a in args.posonlyargs + args.args][1:]
    return Signature(
        tuple(positional + [a.arg for a in args.kwonlyargs]), len(positional), args.kwarg is not None
    )


@cache
def server_args_fields() -> frozenset[str]:
    """ServerArgs' fields: the input namespaces listed in server_args.py's _INPUT_NAMESPACES."""
    tree = parse("srt/server_args.py")
    imports = {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    listing = next(
        n.value
        for n in tree.body
        if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "_INPUT_NAMESPACES" for t in n.targets)
    )
    fields = class_fields(find_class(tree, "ServerArgs"))
    for element in listing.elts:
        module = imports[element.id].removeprefix("sglang.").replace(".", "/") + ".py"
        fields |= class_fields(find_class(parse(module), element.id))
    return frozenset(fields)


# ---- the adapter against a recorder -----------------------------------------------------------


def sglang_output(tokens: list[int]) -> dict[str, Any]:
    return {
        "output_ids": tokens,
        "meta_info": {
            "finish_reason": {"type": "length", "length": len(tokens)},
            "output_token_logprobs": [(-0.5, t, None) for t in tokens],
        },
    }


class RecordingEngine:
    """Stands in for sglang.srt.entrypoints.engine.Engine; answers as the real one does."""

    calls: list[tuple[str, tuple, dict]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("__init__", args, kwargs))

    def __getattr__(self, name: str):
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            if name == "generate":
                return [sglang_output([7, 8]) for _ in kwargs["input_ids"]]
            if name == "update_weights_from_tensor":
                return True, "ok"
            if name == "flush_cache":
                return types.SimpleNamespace(success=True, message="")
            return None

        return call


@pytest.fixture
def recorded_calls(monkeypatch, tiny_model_dir) -> list[tuple[str, tuple, dict]]:
    """Every call the adapter makes on sglang's Engine through one rollout cycle."""
    module = types.ModuleType("sglang.srt.entrypoints.engine")
    module.Engine = RecordingEngine
    for name in ("sglang", "sglang.srt", "sglang.srt.entrypoints"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.entrypoints.engine", module)
    monkeypatch.setattr(RecordingEngine, "calls", [])
    engine = SGLangRolloutEngine(str(tiny_model_dir), device="cuda", bucket_mb=1, max_lora_rank=8)
    engine.device = torch.device("cpu")  # the tensors stay here: the recorder has no GPU to send them to
    engine.generate([[1, 2], [3]], SamplingParams(max_new_tokens=2, n=2, seed=5, top_k=4, top_p=0.9))
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=2, temperature=0))
    engine.update_weights(
        [("model.embed_tokens.weight", torch.zeros(4, 4)), ("lm_head.weight", torch.zeros(4, 4))]
    )
    engine.finish_update()
    adapter = [("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(8, 4))]
    for _ in range(2):  # the second load unloads the first adapter
        engine.load_adapter({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}, adapter)
        engine.finish_update()
    engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    engine.release_memory()
    engine.resume_memory()
    engine.shutdown()
    return RecordingEngine.calls


def test_the_pinned_release_is_the_one_installed():
    assert f'sglang = ["sglang=={SGLANG_VERSION}"]' in (REPO / "pyproject.toml").read_text()
    assert f"sglang=={SGLANG_VERSION}" in (REPO / "Makefile").read_text()
    version_file = SOURCE / "sglang" / "_version.py"
    written = version_file.read_text() if version_file.exists() else ""
    assert re.search(rf"__version__ = version = ['\"]{re.escape(SGLANG_VERSION)}['\"]", written), (
        f"{SOURCE} does not hold sglang {SGLANG_VERSION}: run `make install`"
    )


def test_every_engine_call_exists_with_the_parameters_passed(recorded_calls):
    engine_cls = find_class(parse("srt/entrypoints/engine.py"), "Engine")
    names = [name for name, _, _ in recorded_calls]
    for expected in ("__init__", "generate", "update_weights_from_tensor", "flush_cache",
                     "release_memory_occupation", "resume_memory_occupation", "shutdown",
                     "load_lora_adapter_from_tensors", "unload_lora_adapter"):  # fmt: skip
        assert expected in names, f"the adapter never called Engine.{expected}"
    for name, args, kwargs in recorded_calls:
        signature = method_signature(engine_cls, name)
        assert len(args) <= signature.positional, f"Engine.{name} takes {signature.positional} positionals"
        if name == "__init__":  # Engine(**kwargs) builds ServerArgs(**kwargs)
            assert signature.var_keyword
            unknown = set(kwargs) - server_args_fields()
            assert not unknown, f"ServerArgs in sglang {SGLANG_VERSION} has no field(s) {sorted(unknown)}"
        else:
            unknown = set(kwargs) - set(signature.params)
            assert not unknown, f"Engine.{name} in sglang {SGLANG_VERSION} takes no {sorted(unknown)}"


def test_sampling_params_are_fields_of_sglangs_sampling_params(recorded_calls):
    fields = class_fields(find_class(parse("srt/sampling/sampling_params.py"), "SamplingParams"))
    sent = [kwargs["sampling_params"] for name, _, kwargs in recorded_calls if name == "generate"]
    dicts = [d for params in sent for d in (params if isinstance(params, list) else [params])]
    assert dicts and {"sampling_seed", "top_k", "top_p", "stop_token_ids", "no_stop_trim"} <= set(dicts[0])
    for params in dicts:
        assert not set(params) - fields, f"sglang SamplingParams has no {sorted(set(params) - fields)}"


def test_seeds_are_honoured_only_in_deterministic_mode_which_the_adapter_turns_on(recorded_calls):
    """sampling_batch_info.py reads sampling_seed only under enable_deterministic_inference."""
    source = (SOURCE / "sglang" / "srt" / "sampling" / "sampling_batch_info.py").read_text()
    assert re.search(r"sampling_seed\s*=\s*\(.*?if enable_deterministic", source, re.S)
    init = next(kwargs for name, _, kwargs in recorded_calls if name == "__init__")
    assert init["enable_deterministic_inference"] is True and init["skip_tokenizer_init"] is True


def returned_dicts(func: ast.FunctionDef) -> list[dict[str, Any]]:
    """The dict literals a function returns, constants kept and other values as None."""
    out = []
    for node in ast.walk(func):
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Dict):
            out.append({
                k.value: v.value if isinstance(v, ast.Constant) else None
                for k, v in zip(node.value.keys, node.value.values, strict=True)
                if isinstance(k, ast.Constant)
            })  # fmt: skip
    return out


def test_every_finish_reason_sglang_builds_is_parsed():
    tree = parse("srt/managers/schedule_batch.py")
    finish_classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.startswith("FINISH")]
    seen = set()
    for cls in finish_classes:
        to_json = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "to_json")
        for reason in returned_dicts(to_json):
            seen.add(reason["type"])
            if reason["type"] == "abort":
                with pytest.raises(RolloutEngineError, match="aborted"):
                    finish_reason_from_sglang(reason)
            else:
                assert finish_reason_from_sglang(reason) == reason["type"], cls.name
    assert seen == {"stop", "length", "abort"}


def test_output_dicts_and_log_prob_entries_have_the_parsed_shape():
    tree = parse("srt/managers/tokenizer_manager.py")
    manager = find_class(tree, "TokenizerManager")
    # Without text: (logprob, token_id, None), the order completion_from_sglang reads.
    detok = next(
        f for f in manager.body if isinstance(f, ast.FunctionDef) and f.name == "detokenize_logprob_tokens"
    )
    tuples = [n for n in ast.walk(detok) if isinstance(n, ast.Tuple) and len(n.elts) == 3]
    assert any(
        [getattr(e, "id", getattr(e, "value", "?")) for e in t.elts] == ["logprob", "token_id", None]
        for t in tuples
    )
    # With skip_tokenizer_init the finished output is {"output_ids": ..., "meta_info": ...}.
    dict_keys = [
        {k.value for k in n.keys if isinstance(k, ast.Constant)}
        for n in ast.walk(tree)
        if isinstance(n, ast.Dict)
    ]
    assert {"output_ids", "meta_info"} in dict_keys
    source = (SOURCE / "sglang" / "srt" / "managers" / "tokenizer_manager.py").read_text()
    assert 'meta_info["output_token_logprobs"] = ' in source
    assert '"finish_reason": recv_obj.finished_reasons[i]' in source
    # ...and the scheduler fills finished_reasons with the FINISH_* classes' to_json().
    streamer = (
        SOURCE / "sglang" / "srt" / "managers" / "scheduler_components" / "output_streamer.py"
    ).read_text()
    assert "finished_reasons.append(req.finished_reason.to_json())" in streamer


def test_the_adapter_is_swapped_by_name_and_generate_serves_the_new_one(recorded_calls):
    lora = [(name, args) for name, args, _ in recorded_calls if "lora" in name]
    assert [(name, args[0]) for name, args in lora] == [
        ("load_lora_adapter_from_tensors", "tandem-v2"),
        ("unload_lora_adapter", "tandem-v2"),
        ("load_lora_adapter_from_tensors", "tandem-v3"),
    ]
    last_generate = [kw for name, _, kw in recorded_calls if name == "generate"][-1]
    assert last_generate["lora_path"] == ["tandem-v3"]
    init = next(kw for name, _, kw in recorded_calls if name == "__init__")
    assert init["enable_lora"] and init["max_lora_rank"] == 8
