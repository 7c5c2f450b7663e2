"""A job's Responses API (`POST .../v1/responses`) through the `openai` SDK against a real service:
recorded token-exact as the chat call that means the same, tool-call items round trip, streaming
events the SDK accumulates, and hostile items refused. One external job serves the whole module."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.api_util import tiny_job
from tests.test_openai_endpoint import record, sampled_runs, submit_external, templated

pytestmark = pytest.mark.usefixtures("ray_cluster")

TOOLS = [{"type": "function", "name": "calculator", "description": "evaluates arithmetic",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def job(live, api):
    spec = tiny_job(
        model={"builtin": "tiny-qwen2-chat"},
        rollout={"source": "external", "external": {"group_size": 2, "trajectories_per_step": 2, "max_pending": 32},
                 "free_cache_after_generate": False},
        trainer={"total_steps": 2, "val_every": 0, "samples_per_step": 2},
        algorithm={"recompute_old_log_probs": True},
        checkpoint={"every": 0},
    )  # fmt: skip
    job_id = submit_external(api, spec)
    yield job_id
    api.post(f"/v1/jobs/{job_id}/cancel")


@pytest.fixture(scope="module")
def tokenizer():
    from engines.tiny_models import build_tokenizer

    return build_tokenizer(chat_template=True)


def sdk(live, job_id: str, trajectory: str) -> OpenAI:
    base = f"{live.url}/v1/jobs/{job_id}/openai/trajectories/{trajectory}/v1"
    return OpenAI(base_url=base, api_key=live.token, max_retries=5)


def sampled_text(tokenizer, run: list[int]) -> str:
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return tokenizer.decode([t for t in run if t != end], skip_special_tokens=True)


def test_a_response_is_recorded_token_exact_and_continues_its_trajectory(live, api, job, tokenizer):
    client = sdk(live, job, "resp-exact")
    first = client.responses.create(model=job, instructions="Answer.", input="12+34=", max_output_tokens=6,
                                    include=["message.output_text.logprobs"])  # fmt: skip
    assert first.object == "response" and first.output[0].type == "message"
    assert first.status in ("completed", "incomplete")
    conversation = [{"role": "user", "content": "12+34="}, *[i.model_dump() for i in first.output],
                    {"role": "user", "content": "again"}]  # fmt: skip
    second = client.responses.create(
        model=job, instructions="Answer.", input=conversation, max_output_tokens=6
    )

    rec = record(api, job, "resp-exact")
    assert rec["calls"] == 2 and rec["segments"] == 1  # the output items sent back continue the segment
    seg = rec["segment_list"][0]
    system = {"role": "system", "content": "Answer."}
    assert seg["prompt_ids"] == templated(tokenizer, [system, {"role": "user", "content": "12+34="}])
    runs = sampled_runs(seg)
    assert [sampled_text(tokenizer, r) for r in runs] == [first.output_text, second.output_text]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    returned = [lp.logprob for lp in first.output[0].content[0].logprobs]
    recorded = [lp for lp, t in zip(seg["log_probs"][: len(runs[0])], runs[0], strict=True) if t != end]
    assert returned == pytest.approx(recorded, abs=1e-6)
    assert first.usage.input_tokens == len(seg["prompt_ids"])
    assert first.usage.output_tokens == len(runs[0])
    assert first.tandem["trajectory_id"] == "resp-exact"  # type: ignore[attr-defined]


def test_tool_items_are_templated_as_the_chat_call_that_means_the_same(live, api, job, tokenizer):
    items = [
        {"role": "user", "content": "2*3="},
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "calculator",
            "arguments": '{"expression": "2*3"}',
        },
        {"type": "function_call_output", "call_id": "c1", "output": "6"},
    ]
    sdk(live, job, "resp-tools").responses.create(model=job, input=items, tools=TOOLS, max_output_tokens=3)
    messages = [
        {"role": "user", "content": "2*3="},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "6"},
    ]  # fmt: skip
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS
    ]
    sdk(live, job, "chat-tools").chat.completions.create(
        model=job, messages=messages, tools=chat_tools, max_tokens=3
    )
    via_responses = record(api, job, "resp-tools")["segment_list"][0]["prompt_ids"]
    assert via_responses == record(api, job, "chat-tools")["segment_list"][0]["prompt_ids"]
    prompt = tokenizer.decode(via_responses)
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>' in prompt
    assert prompt.endswith("<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n")


def test_streaming_sends_the_events_the_sdk_accumulates(live, api, job, tokenizer):
    client = sdk(live, job, "resp-stream")
    events = list(client.responses.create(model=job, input="1+1=", max_output_tokens=5, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    seg = record(api, job, "resp-stream")["segment_list"][0]
    assert text == sampled_text(tokenizer, sampled_runs(seg)[0]) == events[-1].response.output_text
    # the SDK's stream helper accumulates the same events into its final response
    with sdk(live, job, "resp-stream-2").responses.stream(
        model=job, input="2+2=", max_output_tokens=400
    ) as stream:
        final = stream.get_final_response()
    seg = record(api, job, "resp-stream-2")["segment_list"][0]
    assert final.output_text == sampled_text(tokenizer, sampled_runs(seg)[0])


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name"),
    ({"input": []}, "input"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": 7}, "input"),
])  # fmt: skip
def test_hostile_bodies_are_refused_naming_the_field_and_store_nothing(live, api, job, body, param):
    got = api.post(f"/v1/jobs/{job}/openai/trajectories/resp-bad/v1/responses", json={"model": job, **body})
    assert got.status_code == 422, got.text
    assert got.json()["error"]["param"] in (param, f"{param}.str")  # a union names the branch it tried first
    assert api.get(f"/v1/jobs/{job}/trajectories/resp-bad").status_code == 404
