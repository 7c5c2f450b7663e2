"""A job's OpenAI-compatible endpoint, through the `openai` SDK against a real service (uvicorn on
127.0.0.1, Ray, SQLite): trajectories recorded token-exact, tool calls, bad inputs, concurrent agents,
and a job that trains on what agents report. One external job serves the whole module."""

from __future__ import annotations

import time

import httpx
import pytest
from openai import OpenAI

from examples import agent_openai
from tests.api_util import TERMINAL, tiny_job, wait_for, wait_for_step

pytestmark = pytest.mark.usefixtures("ray_cluster")

GROUP, PER_STEP, STEPS = 2, 4, 3


@pytest.fixture(scope="module")
def job(live, api):
    spec = tiny_job(
        model={"builtin": "tiny-qwen2-chat"},
        rollout={"source": "external", "external": {"group_size": GROUP, "trajectories_per_step": PER_STEP,
                                                     "max_pending": 16}, "free_cache_after_generate": False},
        trainer={"total_steps": STEPS, "val_every": 0, "samples_per_step": 4},
        algorithm={"recompute_old_log_probs": True},
        checkpoint={"every": 0},
    )  # fmt: skip
    job_id = submit_external(api, spec)
    yield job_id
    api.post(f"/v1/jobs/{job_id}/cancel")


def submit_external(api, spec: dict) -> str:
    """Submits a job fed by agents and waits until its endpoint serves; its id."""
    created = api.post("/v1/jobs", json=spec)
    assert created.status_code == 201, created.text
    job_id = created.json()["id"]
    wait_for_endpoint(api, job_id)
    return job_id


def wait_for_endpoint(api, job_id: str, timeout_s: float = 180) -> None:
    """Until the job runs and its endpoint answers (a probe for an unknown trajectory: 404, not 503)."""
    wait_for(api, job_id, ("running",), timeout_s=timeout_s)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:  # the endpoint holds calls until its workers are up: the probe may outwait the client
            if api.get(f"/v1/jobs/{job_id}/trajectories/probe").status_code == 404:
                return
        except httpx.TimeoutException:
            continue
        time.sleep(0.5)
    raise AssertionError(f"the endpoint of {job_id} did not come up within {timeout_s} s")


def client(live, job_id: str, trajectory: str) -> OpenAI:
    base = f"{live.url}/v1/jobs/{job_id}/openai/trajectories/{trajectory}/v1"
    return OpenAI(base_url=base, api_key=live.token, max_retries=5)


@pytest.fixture(scope="module")
def tokenizer():
    from engines.models.tiny_models import build_tokenizer

    return build_tokenizer(chat_template=True)  # tiny-qwen2-chat's


def templated(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def record(api, job_id: str, tid: str) -> dict:
    got = api.get(f"/v1/jobs/{job_id}/trajectories/{tid}")
    assert got.status_code == 200, got.text
    return got.json()


def sampled_runs(segment: dict) -> list[list[int]]:
    """The sampled tokens of each call: the runs of loss mask 1."""
    runs, current = [], []
    for token, mask in zip(segment["tokens"], segment["loss_mask"], strict=True):
        if mask:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_a_trajectory_is_recorded_token_exact(live, api, job, tokenizer):
    sdk = client(live, job, "exact-1")
    messages = [{"role": "user", "content": "12+34="}]
    first = sdk.chat.completions.create(model=job, messages=messages, max_tokens=6, logprobs=True)
    text1 = first.choices[0].message.content
    messages += [{"role": "assistant", "content": text1}, {"role": "user", "content": "again"}]
    second = sdk.chat.completions.create(model=job, messages=messages, max_tokens=6)
    text2 = second.choices[0].message.content

    rec = record(api, job, "exact-1")
    assert rec["calls"] == 2 and rec["segments"] == 1 and rec["state"] == "open"
    seg = rec["segment_list"][0]
    # the first prompt exactly as templated, the later one as a delta after the sampled tokens
    assert seg["prompt_ids"] == templated(tokenizer, messages[:1])
    runs = sampled_runs(seg)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    decoded = [tokenizer.decode([t for t in run if t != end], skip_special_tokens=True) for run in runs]
    assert decoded == [text1, text2]
    # what the model saw for call 2 is the templated conversation (the turn-end token either sampled or added)
    call2_prompt = seg["prompt_ids"] + seg["tokens"][: len(seg["tokens"]) - len(runs[1])]
    assert tokenizer.decode(call2_prompt).endswith(
        "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    )
    assert len(seg["log_probs"]) == len(seg["tokens"])
    returned = [c.logprob for c in first.choices[0].logprobs.content]
    recorded = [lp for lp, t in zip(seg["log_probs"][: len(runs[0])], runs[0], strict=True) if t != end]
    assert returned == pytest.approx(recorded, abs=1e-6)
    assert seg["weight_versions"] == [0, 0]

    # a call that rewrites the history starts a new segment, and says why
    rewritten = [{"role": "user", "content": "99+1="}]
    third = sdk.chat.completions.create(model=job, messages=rewritten, max_tokens=4)
    assert third.tandem["new_segment"] == "the messages rewrite the history of the earlier calls"
    rec = record(api, job, "exact-1")
    assert rec["segments"] == 2
    assert rec["segment_list"][1]["prompt_ids"] == templated(tokenizer, rewritten)


def test_tool_calls_round_trip(live, api, job, tokenizer):
    from workers.chat_serving import ChatRenderer

    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    sdk = client(live, job, "tools-1")
    messages = [
        {"role": "user", "content": "2*3="},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "6"},
    ]  # fmt: skip
    out = sdk.chat.completions.create(model=job, messages=messages, tools=tools, max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = tokenizer.decode(record(api, job, "tools-1")["segment_list"][0]["prompt_ids"])
    assert '<tools>\n{"function": {"name": "calculator"' in prompt  # the tools, in the system turn
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}'
        in prompt
    )
    assert prompt.endswith("<|im_start|>tool\n6<|im_end|>\n<|im_start|>assistant\n")
    # the model's own tool call, parsed from its tokens as the SDK gets it
    reply = ChatRenderer(tokenizer).reply(
        tokenizer.encode('ok <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call><|im_end|>'),
        "call_x", parse_tools=True,
    )  # fmt: skip
    assert reply["content"] == "ok"
    assert reply["tool_calls"][0]["function"] == {"name": "calculator", "arguments": '{"expression": "1+1"}'}


def test_streaming_and_completions(live, api, job, tokenizer):
    sdk = client(live, job, "stream-1")
    chunks = list(sdk.chat.completions.create(
        model=job, messages=[{"role": "user", "content": "1+1="}], max_tokens=5, stream=True))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    seg = record(api, job, "stream-1")["segment_list"][0]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert text == tokenizer.decode([t for t in sampled_runs(seg)[0] if t != end], skip_special_tokens=True)
    done = client(live, job, "text-1").completions.create(model=job, prompt="7+8=", max_tokens=4)
    seg = record(api, job, "text-1")["segment_list"][0]
    assert seg["prompt_ids"] == tokenizer.encode("7+8=", add_special_tokens=False)
    assert done.choices[0].text == tokenizer.decode(sampled_runs(seg)[0], skip_special_tokens=True)
    assert [m.id for m in sdk.models.list().data][0] == job
    two = client(live, job, "pair").chat.completions.create(
        model=job, messages=[{"role": "user", "content": "5+5="}], max_tokens=3, n=2, seed=7
    )
    assert len(two.choices) == 2 and two.tandem["forks"] == ["pair.1"]
    fork = record(api, job, "pair.1")["segment_list"][0]
    assert fork["prompt_ids"] == record(api, job, "pair")["segment_list"][0]["prompt_ids"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert two.choices[1].message.content == tokenizer.decode(
        [t for t in sampled_runs(fork)[0] if t != end], skip_special_tokens=True
    )


def test_bad_inputs_are_refused_and_store_nothing(live, api, job):
    base = f"/v1/jobs/{job}/openai/trajectories/bad-1/v1/chat/completions"
    ok = {"model": job, "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2}
    robot = api.post(base, json={**ok, "messages": [{"role": "robot", "content": "x"}]})
    assert robot.status_code == 422 and robot.json()["error"]["param"].startswith("messages")
    empty = api.post(base, json={**ok, "messages": []})
    assert empty.status_code == 422 and empty.json()["error"]["param"] == "messages"
    other = api.post(base, json={**ok, "model": "gpt-4o"})
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"
    assert api.get(f"/v1/jobs/{job}/trajectories/bad-1").status_code == 404  # nothing stored
    unknown = api.post(f"/v1/jobs/{job}/trajectories/nobody/reward", json={"reward": 1.0})
    assert unknown.status_code == 404
    assert api.post(base, json=ok).status_code == 200
    bad_reward = api.post(f"/v1/jobs/{job}/trajectories/bad-1/reward", json={"reward": "high"})
    assert bad_reward.status_code == 422 and bad_reward.json()["error"]["param"] == "reward"
    assert (
        api.post(
            f"/v1/jobs/{job}/trajectories/bad-1/reward", json={"reward": 0.0, "task_id": "solo"}
        ).status_code
        == 200
    )
    again = api.post(f"/v1/jobs/{job}/trajectories/bad-1/reward", json={"reward": 1.0})
    assert again.status_code == 409 and record(api, job, "bad-1")["reward"] == 0.0
    after = api.post(base, json=ok)  # a rewarded trajectory takes no more calls
    assert after.status_code == 409 and record(api, job, "bad-1")["calls"] == 1
    # a job not fed externally
    plain = api.post("/v1/jobs", json=tiny_job(trainer={"total_steps": 1, "val_every": 0})).json()["id"]
    api.post(f"/v1/jobs/{plain}/cancel")  # while queued: the check reads its spec, no worker need start
    refused = api.post(f"/v1/jobs/{plain}/openai/v1/chat/completions", json={**ok, "model": plain})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "not_external"


def test_concurrent_agents_feed_steps_that_train_on_their_rewards(live, api, job):
    """Steps 1..STEPS from examples/agent_openai.py's 8 concurrent agents: each step's scores are the
    rewards the agents posted, and the trainer's log-probs of the recorded tokens match the rollout engine's (after each sync)."""
    for step in range(1, STEPS + 1):
        rewards = agent_openai.main([
            "--url", live.url, "--job", job, "--key", live.token, "--task", "arithmetic", "--reward", "digits",
            "--problems", str(PER_STEP // GROUP), "--group-size", str(GROUP), "--agents", "8",
            "--max-tokens", "6", "--seed", str(step),
        ])  # fmt: skip
        got = wait_for_step(api, job, step, timeout_s=180)
        assert got["status"] == "running" or step == STEPS, got
        if step < STEPS:  # the next step's calls are sampled with the weights this step synced
            probe = client(live, job, f"version-{step}").chat.completions.create(
                model=job, messages=[{"role": "user", "content": "1="}], max_tokens=2
            )
            assert probe.tandem["weight_version"] == step
        metrics = api.get(
            f"/v1/jobs/{job}/metrics", params={"keys": "critic/score/mean,rollout/log_prob_diff_max"}
        ).json()
        row = next(r for r in metrics["data"] if r["step"] == step)["values"]
        assert row["critic/score/mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
        assert row["rollout/log_prob_diff_max"] <= 1e-4
    final = wait_for(api, job, TERMINAL, timeout_s=120)
    assert final["status"] == "succeeded"
    samples = api.get(f"/v1/jobs/{job}/samples", params={"step": STEPS}).json()["data"]
    assert samples and samples[0]["turns"][0]["role"] == "assistant"  # the calls are the turns
    shown = samples[0]["trajectory"]  # which agent trajectory, grouped by its task id
    assert shown["id"].startswith(f"p{STEPS}-") and shown["id"].rsplit("-", 1)[0] == samples[0]["uid"]
    late = api.post(f"/v1/jobs/{job}/openai/v1/chat/completions",
                    json={"model": job, "messages": [{"role": "user", "content": "x"}]})  # fmt: skip
    assert late.status_code == 409 and late.json()["error"]["code"] == "not_running"
