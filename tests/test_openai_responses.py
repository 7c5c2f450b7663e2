"""A job's Responses API (`POST .../v1/responses`) through the `openai` SDK against a real service:
recorded token-exact as the chat call that means the same, tool-call items round trip, streaming
events the SDK accumulates, and hostile items refused. One external job serves the whole module."""

from __future__ import annotations

import json

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
    from engines.models.tiny_models import TinyModelSpec, build_tiny_model

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
        rollout={"source": "external", "external": {"group_size": 2, "trajectories_per_step": 4, "max_pending": 32},
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
    from engines.models.tiny_models import build_tokenizer

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
    ({"input": "x", "top_logprobs": 5}, "top_logprobs"),
])  # fmt: skip
def test_hostile_bodies_are_refused_naming_the_field_and_store_nothing(live, api, job, body, param):
    got = api.post(f"/v1/jobs/{job}/openai/trajectories/resp-bad/v1/responses", json={"model": job, **body})
    assert got.status_code == 422, got.text
    assert got.json()["error"]["param"] in (param, f"{param}.str")  # a union names the branch it tried first
    assert api.get(f"/v1/jobs/{job}/trajectories/resp-bad").status_code == 404


SCHEMA = {"type": "object", "properties": {"value": {"type": "integer", "minimum": 0, "maximum": 999},
                                        "op": {"enum": ["add", "mul"]}}, "required": ["value", "op"]}  # fmt: skip
FORMATS = {
    "responses": {"text": {"format": {"type": "json_schema", "name": "out", "strict": True, "schema": SCHEMA}}},
    "chat/completions": {"response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA}}},
}  # fmt: skip
CHOICES = {
    "responses": [("required", "calculator"), ({"type": "function", "name": "lookup"}, "lookup")],
    "chat/completions": [("required", "calculator"), ({"type": "function", "function": {"name": "lookup"}}, "lookup")],
}  # fmt: skip
BOUNDED = [{**TOOLS[0], "parameters": {"type": "object", "required": ["expression"],
                                       "properties": {"expression": {"type": "string", "maxLength": 12}}}}]  # fmt: skip
LOOKUP = {"type": "function", "name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"enum": ["x", "y"]}}, "required": ["key"]}}  # fmt: skip


def call(api, job, route: str, tid: str, extra: dict, tools: list | None = None):
    tools = tools if tools is not None else TOOLS
    if route == "responses":
        body = {"input": "1+1=", "max_output_tokens": 160, "tools": tools}
    else:
        body = {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 160,
                "tools": [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]}  # fmt: skip
    return api.post(
        f"/v1/jobs/{job}/openai/trajectories/{tid}/v1/{route}", json={"model": job, **body, **extra}
    )


def reply(route: str, got: dict) -> tuple[str, list[tuple[str, str]]]:
    """(the reply's text, its tool calls as (name, arguments)) on either route."""
    if route == "responses":
        text = "".join(p["text"] for i in got["output"] if i["type"] == "message" for p in i["content"])
        return text, [(i["name"], i["arguments"]) for i in got["output"] if i["type"] == "function_call"]
    message = got["choices"][0]["message"]
    return message["content"] or "", [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]  # fmt: skip


@pytest.mark.parametrize("route", ["responses", "chat/completions"])
def test_structured_outputs_hold_and_the_record_states_the_constraint(live, api, job, tokenizer, route):
    """json_schema with tool_choice none: every reply parses and validates; the record names the
    constraint and its sampled tokens are the reply's (token-exact)."""
    import jsonschema

    for k in range(3):
        tid = f"fmt-{route[:4]}-{k}"
        got = call(api, job, route, tid, {**FORMATS[route], "tool_choice": "none", "seed": k})
        assert got.status_code == 200, got.text
        text, calls = reply(route, got.json())
        assert calls == []
        jsonschema.validate(json.loads(text), SCHEMA)
        seg = record(api, job, tid)["segment_list"][0]
        assert sampled_text(tokenizer, sampled_runs(seg)[0]) == text
        assert seg["constraints"] == [
            {"call": 0, "kind": "json_schema", "grammar_sha256": seg["constraints"][0]["grammar_sha256"]}
        ]


@pytest.mark.parametrize("route", ["responses", "chat/completions"])
def test_forced_tool_choices_always_yield_one_call_of_that_tool(live, api, job, route):
    import jsonschema

    """Arguments are bounded (maxLength): an unbounded string from random weights may outrun max tokens."""
    schemas = {"calculator": BOUNDED[0]["parameters"], "lookup": LOOKUP["parameters"]}
    for choice, name in CHOICES[route]:
        for k in range(2):
            got = call(api, job, route, f"forced-{route[:4]}-{name}-{k}", {"tool_choice": choice, "seed": k,
                                                                         "parallel_tool_calls": False}, BOUNDED + [LOOKUP])  # fmt: skip
            assert got.status_code == 200, got.text
            _, calls = reply(route, got.json())
            assert len(calls) == 1 and calls[0][0] in ({name} if name == "lookup" else set(schemas)), calls
            jsonschema.validate(json.loads(calls[0][1]), schemas[calls[0][0]])


DEEP: dict = {"type": "string"}
for _ in range(300):
    DEEP = {"type": "array", "items": DEEP}
HOSTILE = [
    ({"type": "object", "not": {"type": "string"}}, "keyword 'not'"),
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}, "recursive"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200} for i in range(400)}}, "characters"),
    (DEEP, "nests deeper"),
    ([1, 2], "must be an object"),
]  # fmt: skip


@pytest.mark.parametrize("route", ["responses", "chat/completions"])
@pytest.mark.parametrize(("schema", "says"), HOSTILE, ids=["keyword", "recursive", "huge", "deep", "list"])
def test_hostile_schemas_are_a_4xx_naming_the_field_and_store_nothing(live, api, job, route, schema, says):
    if route == "responses":
        extra = {"text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}
    else:
        extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    got = call(api, job, route, "hostile", extra)
    assert 400 <= got.status_code < 500, got.text
    error = got.json()["error"]
    assert error["param"] == ("text.format" if route == "responses" else "response_format"), error
    assert says in error["message"]
    assert api.get(f"/v1/jobs/{job}/trajectories/hostile").status_code == 404


@pytest.mark.parametrize(("route", "extra", "param"), [
    ("responses", {"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ("chat/completions", {"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("responses", {"tool_choice": "required", "tools": [{**LOOKUP, "parameters": {"type": "object", "oneOf": []}}]},
     "tools[0].parameters"),
    ("chat/completions", {"tool_choice": "required", "tools": []}, "tool_choice"),
])  # fmt: skip
def test_tool_choices_that_cannot_hold_are_a_422_naming_the_field(live, api, job, route, extra, param):
    tools = extra.pop("tools", None)
    if tools is not None and route == "chat/completions":
        extra["tools"] = tools
        tools = None
    got = call(api, job, route, "bad-choice", extra, tools)
    assert got.status_code == 422, got.text
    assert got.json()["error"]["param"] == param
    assert api.get(f"/v1/jobs/{job}/trajectories/bad-choice").status_code == 404


def test_an_agents_sdk_agent_with_its_default_model_and_output_type_trains_the_job(live, api, job, tokenizer):
    """examples/agent_agents_sdk.py: `Agent(model=<job>, output_type=Answer)` (OpenAIResponsesModel,
    a json_schema text.format), one group of runs: every final output parses into `Answer`; every
    run's calls are one trajectory whose first prompt is the templated instructions + task
    (tool_choice none: no tools shown), whose sampled tokens decode to the JSON the SDK parsed, whose
    record states the constraint. A step takes two groups (the job's trajectories_per_step), so the
    first group's records are read before any step can consume them; a second group fills step 1."""

    def agents(seed: int) -> list[tuple[str, float, str]]:
        return agent_agents_sdk.main(["--url", live.url, "--job", job, "--key", live.token, "--task", "arithmetic",
                                      "--reward", "digits", "--problems", "1", "--group-size", "2", "--agents", "2",
                                      "--max-tokens", "48", "--max-turns", "2", "--seed", str(seed),
                                      "--output-type", "answer", "--tool-choice", "none"])  # fmt: skip

    runs = agents(3)
    assert len(runs) == 2
    system = {"role": "system", "content": "Solve the arithmetic problem; use the calculator."}
    for trajectory, reward, answer in runs:
        assert answer.lstrip("-").isdigit(), answer  # the SDK parsed the reply into Answer
        rec = record(api, job, trajectory)
        assert rec["state"] == "rewarded" and rec["reward"] == pytest.approx(reward) and rec["calls"] == 1
        seg = rec["segment_list"][0]
        first_user = seg["messages"][1]["content"]
        assert seg["prompt_ids"] == templated(tokenizer, [system, {"role": "user", "content": first_user}])
        text = sampled_text(tokenizer, sampled_runs(seg)[0])
        assert agent_agents_sdk.Answer.model_validate_json(text).value == int(answer)
        assert seg["tokens"] == tokenizer.encode(text, add_special_tokens=False) + [seg["tokens"][-1]]
        assert seg["constraints"][0]["kind"] == "json_schema"
        assert len(seg["log_probs"]) == len(seg["tokens"]) == len(seg["loss_mask"])
    runs += agents(4)
    step = wait_for_step(api, job, 1, timeout_s=240)
    assert step["step"] >= 1, step
    metrics = api.get(f"/v1/jobs/{job}/metrics", params={"keys": "critic/score/mean"})
    row = next(r for r in metrics.json()["data"] if r["step"] == 1)["values"]
    assert row["critic/score/mean"] == pytest.approx(sum(r for _, r, _ in runs) / 4, abs=1e-6)


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
