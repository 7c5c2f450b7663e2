"""The sglang adapter's pure translations, checked without sglang (it cannot be installed here).

The fake outputs below have the shape sglang's Engine.generate returns with skip_tokenizer_init
and return_logprob=True, as built in TokenizerManager._handle_batch_output and
detokenize_logprob_tokens (sgl-project/sglang, python/sglang/srt/managers/tokenizer_manager.py),
with finish reasons from the FINISH_*.to_json methods in
python/sglang/srt/managers/schedule_batch.py.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from engines.rollout import available_backends, build_rollout_engine, probe_sglang
from engines.rollout.base import Completion, RolloutEngine, RolloutEngineError, SamplingParams
from engines.rollout.sglang import (
    SGLangRolloutEngine,
    bucket_named_tensors,
    check_sglang_result,
    completion_from_sglang,
    is_sglang_weight,
    sampling_params_per_row,
    to_sglang_sampling_params,
)


def sglang_output(
    tokens: list[int], log_probs: list[float], finish: dict | None, as_lists: bool = False
) -> dict:
    """One element of Engine.generate's list, as sglang builds it."""
    entries = [(lp, tok, None) for lp, tok in zip(log_probs, tokens, strict=True)]
    return {
        "output_ids": list(tokens),
        "meta_info": {
            "id": "3f2a",
            "finish_reason": finish,
            "prompt_tokens": 5,
            "weight_version": "default",
            "input_token_logprobs": [(None, 11, None)],
            "output_token_logprobs": [list(e) for e in entries] if as_lists else entries,
            "completion_tokens": len(tokens),
            "cached_tokens": 0,
            "e2e_latency": 0.01,
        },
    }


# ---- probing and the registry -----------------------------------------------------------------


def test_probe_names_the_missing_package_and_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # makes `import sglang` fail here
    message = probe_sglang()
    assert message is not None
    assert "rollout backend 'sglang' needs the sglang package" in message
    assert "pip install 'tandem-rl[sglang]'" in message and "import failed" in message


def test_probe_is_quiet_when_sglang_imports(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", types.ModuleType("sglang"))
    assert probe_sglang() is None


def test_registry_reports_and_refuses_a_missing_sglang(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "sglang", None)
    backends = available_backends()
    assert backends["hf"] is None and "sglang package" in backends["sglang"]
    with pytest.raises(ImportError, match="needs the sglang package"):
        build_rollout_engine("sglang", tmp_path, device="cuda")


def test_registry_names_an_unknown_backend_and_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"unknown rollout backend 'trt'.*'hf', 'sglang', 'vllm'"):
        build_rollout_engine("trt", tmp_path)


def test_registry_builds_the_hf_engine(tiny_model_dir):
    engine = build_rollout_engine("hf", tiny_model_dir, device="cpu", dtype="float32")
    assert len(engine.generate([[3, 4]], SamplingParams(max_new_tokens=2, temperature=0))) == 1


def test_sglang_engine_refuses_cpu():
    with pytest.raises(ValueError, match="CUDA only"):
        SGLangRolloutEngine("/nowhere", device="cpu")


# ---- sampling params ----------------------------------------------------------------------------


def test_sampling_params_translation():
    params = SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=0, stop_token_ids=[9, 4])
    out = to_sglang_sampling_params(params, eos_token_ids=[4, 2])
    assert out == {
        "max_new_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "stop_token_ids": [2, 4, 9],
        "no_stop_trim": True,
    }
    assert "n" not in out  # n is done by repeating prompts
    greedy = to_sglang_sampling_params(SamplingParams(temperature=0, top_k=-1))
    assert greedy["temperature"] == 0 and greedy["top_k"] == 1
    assert to_sglang_sampling_params(SamplingParams(top_k=20))["top_k"] == 20


class RowEcho(RolloutEngine):
    """Answers each row with its own tokens: shows what `RolloutEngine.generate` does around `_generate`."""

    def _generate(self, rows: list[list[int]], params: SamplingParams) -> list[Completion]:
        return [Completion(list(row), [0.0] * len(row), "length") for row in rows]

    def update_weights(self, named_tensors) -> None:
        pass


def test_n_repeats_prompts_prompt_major_and_seeds_differ_per_row(tiny_model_dir):
    engine = RowEcho(tiny_model_dir)
    engine.finish_update()
    out = engine.generate([[1, 2], [3]], SamplingParams(n=2))
    assert [c.token_ids for c in out] == [[1, 2], [1, 2], [3], [3]]
    assert [(c.prompt_index, c.weight_version) for c in out] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert isinstance(sampling_params_per_row(SamplingParams(), 4), dict)
    seeded = sampling_params_per_row(SamplingParams(seed=10), 4)
    assert [p["sampling_seed"] for p in seeded] == [10, 11, 12, 13]


# ---- outputs ------------------------------------------------------------------------------------


def test_completion_from_a_stopped_output():
    out = sglang_output([5, 6, 2], [-0.5, -1.25, -0.1], {"type": "stop", "matched": 2})
    completion = completion_from_sglang(out)
    assert completion.token_ids == [5, 6, 2]
    assert completion.log_probs == [-0.5, -1.25, -0.1]
    assert completion.finish_reason == "stop"


def test_completion_from_a_length_output_after_a_json_round_trip():
    out = sglang_output([8, 8], [-2.0, -3.0], {"type": "length", "length": 2}, as_lists=True)
    completion = completion_from_sglang(out)
    assert completion.finish_reason == "length" and completion.token_ids == [8, 8]


def test_stop_string_matches_map_to_stop():
    out = sglang_output([5], [-0.1], {"type": "stop", "matched": "</answer>"})
    assert completion_from_sglang(out).finish_reason == "stop"


@pytest.mark.parametrize(
    ("finish", "message"),
    [
        (
            {"type": "abort", "message": "out of memory", "status_code": 500, "err_type": None},
            "out of memory",
        ),
        (None, "unfinished"),
    ],
)
def test_aborted_or_unfinished_outputs_raise(finish, message):
    with pytest.raises(RolloutEngineError, match=message):
        completion_from_sglang(sglang_output([5], [-0.1], finish))


def test_outputs_without_log_probs_or_with_disagreeing_ids_raise():
    out = sglang_output([5], [-0.1], {"type": "length", "length": 1})
    del out["meta_info"]["output_token_logprobs"]
    with pytest.raises(RolloutEngineError, match="return_logprob=True"):
        completion_from_sglang(out)
    out = sglang_output([5, 6], [-0.1, -0.2], {"type": "length", "length": 2})
    out["output_ids"] = [5]
    with pytest.raises(RolloutEngineError, match="disagree"):
        completion_from_sglang(out)


# ---- weights ------------------------------------------------------------------------------------


def test_buckets_respect_the_byte_limit_and_keep_order():
    sizes = [10, 10, 30, 5, 100, 1, 1]  # float32 elements: 40, 40, 120, 20, 400, 4, 4 bytes
    stream = [(f"w{i}", torch.zeros(n)) for i, n in enumerate(sizes)]
    buckets = list(bucket_named_tensors(stream, bucket_bytes=100))
    assert [[name for name, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3"], ["w4"], ["w5", "w6"]]
    assert [name for b in buckets for name, _ in b] == [name for name, _ in stream]


def test_a_tensor_larger_than_the_bucket_travels_alone():
    stream = [
        ("small", torch.zeros(2)),
        ("huge", torch.zeros(1000, dtype=torch.bfloat16)),
        ("tail", torch.zeros(2)),
    ]
    buckets = list(bucket_named_tensors(stream, bucket_bytes=64))
    assert [[n for n, _ in b] for b in buckets] == [["small"], ["huge"], ["tail"]]


def test_buckets_are_lazy():
    pulled = []

    def stream():
        for i in range(6):
            pulled.append(i)
            yield f"w{i}", torch.zeros(4)  # 16 bytes each

    first = next(bucket_named_tensors(stream(), bucket_bytes=32))
    assert [n for n, _ in first] == ["w0", "w1"] and pulled == [0, 1, 2]
    with pytest.raises(ValueError, match="positive"):
        next(bucket_named_tensors(stream(), bucket_bytes=0))


def test_weight_names_pass_through_except_rotary_buffers():
    assert is_sglang_weight("model.layers.0.self_attn.q_proj.weight")
    assert is_sglang_weight("lm_head.weight")
    assert not is_sglang_weight("model.layers.0.self_attn.rotary_emb.inv_freq")


def test_sglang_results_are_checked():
    check_sglang_result((True, "Succeeded to update model weights."), "update")
    check_sglang_result(None, "flush_cache")
    with pytest.raises(RolloutEngineError, match="update failed: shape mismatch"):
        check_sglang_result((False, "shape mismatch"), "update")
    with pytest.raises(RolloutEngineError, match="flush_cache failed"):
        check_sglang_result(types.SimpleNamespace(success=False, message="busy"), "flush_cache")
