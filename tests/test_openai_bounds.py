"""Bounded work per call on a job's OpenAI-compatible endpoint, against a real service (uvicorn,
Ray, SQLite) and one external job on tiny-qwen2-chat (a 512-token context): a prompt or max_tokens
beyond the context is a 400 naming the field before anything is generated, and one long call
does not keep the job's other calls from being answered."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import ray

from controller.external import CALL_TOKEN_BUDGET, new_tokens
from controller.external_store import TrajectoryError
from schema.external import server_name
from tests.api_util import tiny_job
from tests.test_openai_endpoint import submit_external
from workers.chat_serving import cut_at_stop

pytestmark = pytest.mark.usefixtures("ray_cluster")

CONTEXT = 512  # tiny-qwen2-chat's max_position_embeddings


@pytest.fixture(scope="module")
def job(live, api):
    spec = tiny_job(
        model={"builtin": "tiny-qwen2-chat"},
        rollout={"source": "external", "external": {"group_size": 1, "trajectories_per_step": 1,
                                                     "max_pending": 64}},
        trainer={"total_steps": 100, "val_every": 0}, checkpoint={"every": 0},
    )  # fmt: skip
    job_id = submit_external(api, spec)
    yield job_id
    api.post(f"/v1/jobs/{job_id}/cancel")


def chat(client: httpx.Client, job: str, tid: str, content: str, **fields) -> httpx.Response:
    body = {"model": job, "messages": [{"role": "user", "content": content}], **fields}
    return client.post(
        f"/v1/jobs/{job}/openai/trajectories/{tid}/v1/chat/completions", json=body, timeout=120
    )


def engine_calls(job: str) -> float:
    actor = ray.get_actor(server_name(job))
    return ray.get(actor.stats.remote(), timeout=30)["external/engine_calls_total"]


def refused(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "context_length_exceeded", error
    return error["message"]


def test_a_prompt_beyond_the_context_is_400_naming_messages_before_generating(api, job):
    before = engine_calls(job)
    message = refused(chat(api, job, "long-1", "12+34= " * 5000, max_tokens=4), "messages")
    assert f"context is {CONTEXT} tokens" in message
    completion = api.post(f"/v1/jobs/{job}/openai/trajectories/long-2/v1/completions",
                          json={"model": job, "prompt": "1+1= " * 2000, "max_tokens": 4})  # fmt: skip
    refused(completion, "prompt")
    assert engine_calls(job) == before  # nothing was generated
    for tid in ("long-1", "long-2"):  # and nothing stored
        assert api.get(f"/v1/jobs/{job}/trajectories/{tid}").status_code == 404


def test_max_tokens_beyond_the_room_left_is_400_naming_it_and_a_default_fits(api, job):
    message = refused(chat(api, job, "room-1", "1+1=", max_tokens=CONTEXT), "max_tokens")
    assert f"context of {CONTEXT} tokens: at most" in message
    refused(chat(api, job, "room-2", "1+1=", max_completion_tokens=CONTEXT), "max_completion_tokens")
    # without max_tokens, a prompt near the context gets what room is left, not a refusal
    near = chat(api, job, "room-3", "1 " * 240)
    assert near.status_code == 200, near.text
    usage = near.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= CONTEXT
    # a later call of the same trajectory counts the whole conversation so far
    history = [{"role": "user", "content": "1 " * 240}, near.json()["choices"][0]["message"],
               {"role": "user", "content": "2 " * 240}]  # fmt: skip
    again = api.post(f"/v1/jobs/{job}/openai/trajectories/room-3/v1/chat/completions",
                     json={"model": job, "messages": history, "max_tokens": 4})  # fmt: skip
    refused(again, "messages")
    assert api.get(f"/v1/jobs/{job}/trajectories/room-3").json()["calls"] == 1


def test_a_call_being_templated_does_not_hold_up_a_small_call(live, api, job):
    """A ~1 MB message takes its tokenizer seconds before its refusal; a small call sent after it
    is answered before it (the templating runs beside the endpoint's event loop, not on it)."""
    done: dict[str, float] = {}

    def big() -> None:
        with live.client() as client:
            response = chat(client, job, "huge-1", "a1 " * 310_000, max_tokens=4)
        done["big"] = time.monotonic()
        done["big_status"] = response.status_code

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(0.3)
    small = chat(api, job, "small-1", "1+1=", max_tokens=2)
    done["small"] = time.monotonic()
    thread.join(180)
    assert small.status_code == 200, small.text
    assert done["big_status"] == 400
    assert done["small"] < done["big"], done


def test_a_long_allowed_call_in_flight_leaves_other_calls_answered(live, api, job):
    answers: dict[str, httpx.Response] = {}

    def long_call() -> None:  # ~220 prompt tokens and all the room left: the longest call allowed
        with live.client() as client:
            answers["long"] = chat(client, job, "long-ok", "1 " * 100, max_tokens=CONTEXT - 230)

    thread = threading.Thread(target=long_call)
    thread.start()
    time.sleep(0.2)
    small = chat(api, job, "beside", "3+4=", max_tokens=2)  # within the client's own timeout
    thread.join(180)
    assert small.status_code == 200, small.text
    assert answers["long"].status_code == 200, answers["long"].text


def test_the_bounds_of_one_call():
    assert new_tokens(10, {}, CONTEXT, "messages") == 256
    assert new_tokens(500, {}, CONTEXT, "messages") == 12  # the default shrinks to the room left
    assert new_tokens(10, {"max_tokens": 502}, CONTEXT, "messages") == 502
    assert new_tokens(10, {"max_tokens": 1000}, None, "messages") == 1000  # a config without a context
    with pytest.raises(TrajectoryError) as err:
        new_tokens(512, {}, CONTEXT, "prompt")
    assert err.value.param == "prompt" and err.value.status == 400
    with pytest.raises(TrajectoryError) as err:
        new_tokens(1000, {"n": 64, "max_tokens": 10_000}, None, "messages")
    assert err.value.param == "n" and str(CALL_TOKEN_BUDGET) in str(err.value)


def test_a_stop_string_costs_a_few_decodes_of_a_long_reply_not_one_per_token():
    from engines.models.tiny_models import build_tokenizer

    tokenizer = build_tokenizer(chat_template=True)
    ids = tokenizer.encode("12+34=46. " * 400 + "STOP then more", add_special_tokens=False)
    decoded = []

    def text_of(prefix: list[int]) -> str:
        decoded.append(len(prefix))
        return tokenizer.decode(prefix)

    cut, stopped = cut_at_stop(text_of, ids, ["STOP", "never"])
    assert (
        stopped and tokenizer.decode(cut).endswith("STOP") and not tokenizer.decode(cut[:-1]).endswith("STOP")
    )
    assert sum(decoded) < 20 * len(ids), f"{len(decoded)} decodes of a {len(ids)}-token reply"
    assert cut_at_stop(text_of, ids, ["never"]) == (ids, False)
    assert cut_at_stop(text_of, ids, []) == (ids, False)


def _tools(count: int) -> list[dict]:
    """`count` functions, each of sixty fields: under the per-schema bound, many together."""
    field = {"type": ["string", "integer", "null"]}
    params = {"type": "object", "properties": {f"p{j}": {"type": "object", "properties": {f"q{k}": field
              for k in range(5)}} for j in range(12)}}  # fmt: skip
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": params}} for i in range(count)]


@pytest.mark.parametrize("count", [64, 200])  # a grammar too big to compile soon; tools too many to build it
def test_tools_whose_grammar_would_hold_a_replica_are_a_422_naming_tools(api, job, count):
    response = chat(api, job, f"many-tools-{count}", "1+1=", tools=_tools(count), tool_choice="required")
    assert response.status_code == 422, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "tools" and "characters" in error["message"], error
    assert api.get(f"/v1/jobs/{job}/trajectories/many-tools-{count}").status_code == 404
    assert chat(api, job, f"after-tools-{count}", "1+1=", max_tokens=2).status_code == 200


def test_choices_of_n_never_overwrite_a_trajectory_that_already_has_their_id(api, job):
    assert chat(api, job, "taken.1", "another agent's conversation", max_tokens=2).status_code == 200
    before = api.get(f"/v1/jobs/{job}/trajectories/taken.1").json()
    response = chat(api, job, "taken", "1+1=", n=2, max_tokens=2)
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert error["param"] == "n" and "'taken.1'" in error["message"], error
    assert api.get(f"/v1/jobs/{job}/trajectories/taken.1").json() == before
    assert api.get(f"/v1/jobs/{job}/trajectories/taken").status_code == 404
    assert chat(api, job, "taken", "1+1=", max_tokens=2).status_code == 200  # n = 1 is served


def test_a_chat_template_that_raises_on_the_messages_is_a_422_naming_them(tmp_path):
    """Real models' templates refuse some conversations (`raise_exception`); that is the caller's 422."""
    import asyncio

    from controller.external import ExternalServer
    from engines.models.tiny_models import build_builtin_model
    from schema.external import ExternalSpec

    path = build_builtin_model("tiny-qwen2-chat", tmp_path)
    template = path / "chat_template.jinja"
    refuse = "{% if messages[-1]['role'] == 'system' %}{{ raise_exception('System message must be first') }}{% endif %}"
    template.write_text(refuse + template.read_text())
    server = ExternalServer("job-x", str(path), ExternalSpec())
    messages = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    out = asyncio.run(server.answer("chat", "late-system", {"model": "job-x", "messages": messages}))
    assert out["error"]["status"] == 422 and out["error"]["param"] == "messages", out
    assert "System message must be first" in out["error"]["message"]
    assert "late-system" not in server.store.trajectories


def test_reward_metadata_nested_past_the_bound_is_a_422_and_leaves_the_trajectory_open(api, job):
    assert chat(api, job, "deep-meta", "1+1=", max_tokens=2).status_code == 200
    deep: dict = {}
    inner = deep
    for _ in range(300):  # a body may nest this deep; the answer's JSON may not
        inner["a"] = inner = {}
    url = f"/v1/jobs/{job}/trajectories/deep-meta/reward"
    response = api.post(url, json={"reward": 1.0, "metadata": deep})
    assert response.status_code == 422, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "metadata" and "deeper than" in error["message"], error
    assert api.post(url, json={"reward": 1.0, "metadata": {"a": {"b": [1]}}}).status_code == 200


@pytest.mark.parametrize(
    "field, value",
    [
        ("logit_bias", {"5": 10.0}),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1.0),
        ("top_logprobs", 3),
    ],
)
def test_a_sampling_change_the_policy_does_not_serve_is_a_422_naming_it_and_its_zero_passes(
    api, job, field, value
):
    body = {"logprobs": True} if field == "top_logprobs" else {}
    before = engine_calls(job)
    answer = chat(api, job, f"unserved-{field}", "hi", max_tokens=2, **body, **{field: value})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["param"] == field and "not served" in answer.json()["error"]["message"]
    assert engine_calls(job) == before  # refused before generating
    zero = {} if field == "logit_bias" else {field: 0}
    assert chat(api, job, f"served-{field}", "hi", max_tokens=2, **body, **zero).status_code == 200
