"""A job's Responses API (`POST .../v1/responses`) through the `openai` SDK against a real service:
recorded token-exact as the chat call that means the same, tool-call items round trip, streaming
events the SDK accumulates, and hostile items refused. One external job serves the whole module."""

from __future__ import annotations

import pytest
from openai import OpenAI

from examples import agent_agents_sdk
from tests.api_util import tiny_job, wait_for, wait_for_step
from tests.test_openai_endpoint import client as sdk
from tests.test_openai_endpoint import record, sampled_runs, submit_external, templated

pytestmark = pytest.mark.usefixtures("ray_cluster")

TOOLS = [{"type": "function", "name": "calculator", "description": "evaluates arithmetic",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """tiny-qwen2-chat with room for a function tool's schema in its character-level prompt."""
    from engines.tiny_models import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(chat_template=True, max_position_embeddings=2048)
    return build_tiny_model(tmp_path_factory.mktemp("models") / "chat-2k", spec)


@pytest.fixture(scope="module")
def live(ray_cluster, tmp_path_factory, model_dir):
    """The module's service, sharing the model's folder (tandem serve --allow-path)."""
    from api.settings import ServeSettings
    from tests.api_util import start_service

    monkey = pytest.MonkeyPatch()
    monkey.setenv("TANDEM_HOME", str(tmp_path_factory.getbasetemp() / "home"))
    svc = start_service(
        tmp_path_factory.mktemp("service"), settings=ServeSettings(allowed_paths=[model_dir.parent])
    )
    yield svc
    svc.stop()
    monkey.undo()


@pytest.fixture(scope="module")
def job(live, api, model_dir):
    spec = tiny_job(
        model={"builtin": None, "path": str(model_dir)},
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


SCHEMA = {"type": "json_schema", "name": "final_output", "strict": True,
          "schema": {"type": "object", "properties": {"response": {"type": "integer"}}, "required": ["response"]}}  # fmt: skip
NAMED = {"type": "function", "name": "calculator"}


@pytest.mark.parametrize(("route", "extra", "param"), [
    ("responses", {"text": {"format": {"type": "json_object"}}}, "text.format"),
    ("responses", {"text": {"format": SCHEMA}}, "text.format"),
    ("responses", {"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ("responses", {"tools": TOOLS, "tool_choice": NAMED}, "tool_choice"),
    ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat/completions", {"response_format": {"type": "json_schema", "json_schema": SCHEMA}}, "response_format"),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("chat/completions", {"tool_choice": {"type": "function", "function": {"name": "calculator"}}}, "tool_choice"),
])  # fmt: skip
def test_constraints_the_engines_would_not_hold_are_refused_never_ignored(
    live, api, job, route, extra, param
):
    """The rollout engines decode without a grammar: a structured output or a forced tool call is a
    422 naming the field, on both routes, and nothing is generated or stored."""
    body = {"model": job, **({"input": "1+1="} if route == "responses" else
                             {"messages": [{"role": "user", "content": "1+1="}]}), **extra}  # fmt: skip
    got = api.post(f"/v1/jobs/{job}/openai/trajectories/resp-forced/v1/{route}", json=body)
    assert got.status_code == 422, got.text
    assert got.json()["error"]["param"] == param and got.json()["error"]["code"] == "unsupported_value"
    assert api.get(f"/v1/jobs/{job}/trajectories/resp-forced").status_code == 404
    plain = (
        {"text": {"format": {"type": "text"}}}
        if route == "responses"
        else {"response_format": {"type": "text"}}
    )
    ok = api.post(f"/v1/jobs/{job}/openai/v1/{route}", json={**body, **plain, "tool_choice": "auto"} | (
        {"max_output_tokens": 2} if route == "responses" else {"max_tokens": 2}))  # fmt: skip
    assert ok.status_code == 200, ok.text


def test_an_agents_sdk_agent_with_its_default_model_trains_the_job_token_exact(live, api, job, tokenizer):
    """examples/agent_agents_sdk.py: `Agent(model=<job>)` (OpenAIResponsesModel) with a @function_tool,
    one group of runs; every run's calls are one trajectory whose first prompt is the templated
    instructions + task with the tool, whose sampled tokens decode to what the SDK got, and the step
    trained on them has the engine's log-probs (the trainer's recomputation within 1e-4)."""
    runs = agent_agents_sdk.main(["--url", live.url, "--job", job, "--key", live.token, "--task", "arithmetic",
                                  "--reward", "digits", "--problems", "1", "--group-size", "2", "--agents", "2",
                                  "--max-tokens", "48", "--max-turns", "2", "--seed", "3"])  # fmt: skip
    assert len(runs) == 2
    tools = [{"type": "function", "function": {"name": "calculator",
                                               "description": "Evaluate an arithmetic expression such as 347*218.",
                                               "parameters": agent_agents_sdk.calculator.params_json_schema,
                                               "strict": True}}]  # fmt: skip
    for trajectory, reward in runs:
        rec = record(api, job, trajectory)
        assert rec["state"] == "rewarded" and rec["reward"] == pytest.approx(reward) and rec["calls"] >= 1
        seg = rec["segment_list"][0]
        assert seg["messages"][0]["role"] == "system"
        first_user = seg["messages"][1]["content"]
        system = {"role": "system", "content": "Solve the arithmetic problem; use the calculator."}
        from workers.chat_serving import ChatRenderer

        expected = ChatRenderer(tokenizer).prompt_ids(
            [system, {"role": "user", "content": first_user}], tools
        )
        assert seg["prompt_ids"] == expected
        assert len(seg["log_probs"]) == len(seg["tokens"]) == len(seg["loss_mask"])
    step = wait_for_step(api, job, 1, timeout_s=240)
    assert step["step"] >= 1, step
    metrics = api.get(
        f"/v1/jobs/{job}/metrics", params={"keys": "critic/score/mean,rollout/log_prob_diff_max"}
    )
    row = next(r for r in metrics.json()["data"] if r["step"] == 1)["values"]
    assert row["critic/score/mean"] == pytest.approx(sum(r for _, r in runs) / 2, abs=1e-6)
    assert row["rollout/log_prob_diff_max"] <= 1e-4


def test_a_client_with_default_retries_reaches_a_job_that_just_started(live, api):
    """The first calls to a new job wait for its endpoint and workers rather than answer 503."""
    spec = tiny_job(model={"builtin": "tiny-qwen2-chat"}, trainer={"total_steps": 1, "val_every": 0},
                    rollout={"source": "external", "external": {"group_size": 1, "trajectories_per_step": 1}},
                    checkpoint={"every": 0})  # fmt: skip
    created = api.post("/v1/jobs", json=spec)
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    try:
        wait_for(api, job_id, ("running",), timeout_s=180)
        client = OpenAI(
            base_url=f"{live.url}/v1/jobs/{job_id}/openai/v1", api_key=live.token
        )  # default retries
        got = client.responses.create(model=job_id, input="1+1=", max_output_tokens=2)
        assert got.output and got.usage.output_tokens >= 1
    finally:
        api.post(f"/v1/jobs/{job_id}/cancel")
