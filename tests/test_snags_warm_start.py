"""SFT warm starts teach what the job then reads: the end-of-turn token of the chat template, and
tool calls in the format of the job's OpenAI endpoint for the agent example's tools."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest

from api.cli_spec import build_spec
from controller.data import SFTDataset, build_dataset
from controller.sink import JsonlSink
from controller.tasks import get_task, write_splits
from controller.trainer import Trainer
from engines.models.tiny_models import BUILTIN_MODELS, build_tokenizer
from examples import agent_openai
from schema.job import JobSpec
from workers.chat_serving import ChatDelta, ChatRenderer, parse_tool_calls
from workers.environments.calculator import evaluate

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def chat_tokenizer():
    return build_tokenizer(chat_template=True)


def warm_start_spec() -> JobSpec:
    """The SFT job that examples/agent_openai.yaml tells its reader to submit first, built as
    `tandem submit` builds it."""
    text = (EXAMPLES / "agent_openai.yaml").read_text()
    line = next(m.group(1) for m in re.finditer(r"^#\s+(tandem submit examples/sft\S+.*)$", text, re.M))
    words = shlex.split(line)
    sets = [words[i + 1] for i, word in enumerate(words) if word == "--set"]
    _, spec = build_spec(str(EXAMPLES.parent / words[2]), sets=sets)
    return spec


def test_the_agent_examples_warm_start_calls_its_tool_as_the_endpoint_parses_calls(chat_tokenizer):
    spec = warm_start_spec()
    (tool,) = agent_openai.TOOLS
    task = get_task(spec.data.builtin_task)
    rows = task.make_split("train", 40) + task.make_split("val", 10)
    calls = [row for row in rows if not any(m["role"] == "tool" for m in row["prompt"])]
    assert len(calls) == 50
    renderer = ChatRenderer(chat_tokenizer)
    for row in calls:
        content, parsed = parse_tool_calls(row["response"], "call")
        assert content == "" and len(parsed) == 1, row["response"]
        function = parsed[0]["function"]
        assert function["name"] == tool["function"]["name"]
        arguments = json.loads(function["arguments"])
        jsonschema.validate(arguments, tool["function"]["parameters"])
        assert str(evaluate(arguments["expression"])) == row["ground_truth"]
        # The trace's prompt is what the endpoint shows the model for this question and these tools.
        user = [m for m in row["prompt"] if m["role"] == "user"]
        assert row["prompt"] == renderer.messages(user, agent_openai.TOOLS)


def test_the_agent_examples_warm_start_keeps_every_trace_within_the_models_context(tmp_path, chat_tokenizer):
    spec = warm_start_spec()
    train, _ = write_splits(get_task(spec.data.builtin_task), tmp_path, train_size=50, val_size=4)
    dataset = build_dataset(
        train, chat_tokenizer, spec.data, sft=True, max_response_length=spec.rollout.max_new_tokens
    )
    assert len(dataset) == 100, dataset.stats  # nothing dropped as too long
    context = BUILTIN_MODELS[spec.model.builtin].max_position_embeddings
    assert max(len(r.ids) + len(r.response_ids or []) for r in dataset.rows) <= context


def test_an_sft_target_of_a_chat_row_ends_with_the_templates_end_of_turn_token(chat_tokenizer):
    end = ChatDelta(chat_tokenizer).turn_end_id
    assert end == chat_tokenizer.convert_tokens_to_ids("<|im_end|>") != chat_tokenizer.eos_token_id
    rows = [
        {"prompt": "hi", "response": "hello"},
        {"prompt": [{"role": "user", "content": "2+2="}], "response": "4"},
    ]
    dataset = SFTDataset([(f"line {i}", r) for i, r in enumerate(rows)], chat_tokenizer)
    for row, record in zip(dataset.rows, rows, strict=True):
        assert row.response_ids is not None and row.response_ids[-1] == end
        assert chat_tokenizer.eos_token_id not in row.response_ids
        # prompt + target is the template's own rendering of the answered turn, up to its end token
        messages = (
            [{"role": "user", "content": record["prompt"]}]
            if isinstance(record["prompt"], str)
            else record["prompt"]
        )
        answered = chat_tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": record["response"]}], tokenize=False
        )
        assert answered.startswith(chat_tokenizer.decode(row.ids + row.response_ids))
    # A response that already ends with the token gets no second one.
    (row,) = SFTDataset([("line 1", {"prompt": "a", "response": "b<|im_end|>"})], chat_tokenizer).rows
    assert row.response_ids == chat_tokenizer("b", add_special_tokens=False)["input_ids"] + [end]


def test_after_sft_on_chat_rows_greedy_generation_stops_on_the_end_of_turn_token(
    ray_cluster, tmp_path, monkeypatch
):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    rows = [{"prompt": f"{a}+{a}=", "response": "ok"} for a in range(10)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = JobSpec.model_validate({
        "method": "sft",
        "model": {"builtin": "tiny-qwen2-chat"},
        "data": {"train_path": str(data), "val_path": str(data)},
        "trainer": {"total_steps": 25, "prompts_per_step": 8, "val_every": 0},
        "rollout": {"max_new_tokens": 8},
        "optim": {"lr": 1e-2},
        "checkpoint": {"every": 0},
    })  # fmt: skip
    Trainer(spec, tmp_path / "job", JsonlSink(tmp_path / "job"), name="sft-chat-end").run()
    export = tmp_path / "job" / "export"
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export)
    delta = ChatDelta(tokenizer)
    end, prompt = delta.turn_end_id, delta.prompt_ids([{"role": "user", "content": "3+3="}])
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=8, eos_token_id=[end, tokenizer.eos_token_id],
            pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    generated = out[0, len(prompt) :].tolist()
    assert generated[-1] == end, tokenizer.decode(generated)
    assert tokenizer.decode(generated[:-1]) == "ok"
