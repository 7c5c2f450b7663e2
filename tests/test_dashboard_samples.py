"""The dashboard's Samples panel in real headless Chromium, showing a real multi-turn job's trajectories.

A GRPO job on the built-in chat model steps the scripted environment of tests/multiturn_envs.py
(tool turn "t1", user turn "again 2", done after the third assistant turn) through the live
service. The panel, following the job's last step or pinned to another, shows each stored
trajectory as the API returns it: the prompt, every turn's role and text in order, the reward, the
finish reason and the trained/response token counts; and the environment's own turns are there.
Same harness as tests/test_dashboard.py (Debian's chromium driven through playwright's API).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.api_util import LiveService, tiny_job, wait_for
from tests.owners_util import upload
from tests.test_dashboard import CHROMIUM_ARGS, TERMINAL, chromium_path, open_job, sync_api

expect = sync_api.expect
SAMPLES = 3


@pytest.fixture(scope="module")
def env_job(live: LiveService, api: httpx.Client) -> dict:
    rows = [{"prompt": f"question {i}", "ground_truth": "", "extra": {"turns": 3}} for i in range(4)]
    data = upload(api, "scripted.jsonl", "".join(json.dumps(row) + "\n" for row in rows).encode())["id"]
    spec = tiny_job(
        model={"builtin": "tiny-qwen2-chat"},
        data={"train_path": data, "builtin_task": None},
        rollout={
            "n": 2,
            "max_new_tokens": 4,
            "environment": "tests.multiturn_envs:ScriptedEnv",
            "max_turns": 4,
            "max_response_tokens": 200,
        },  # fmt: skip
        trainer={"total_steps": 2, "prompts_per_step": 2, "val_every": 0, "samples_per_step": SAMPLES},
        checkpoint={"every": 0, "export_hf": False},
    )
    created = api.post("/v1/jobs", json=spec)
    assert created.status_code == 201, created.text
    job = wait_for(api, created.json()["id"], TERMINAL, timeout_s=300)
    assert job["status"] == "succeeded", job
    return job


@pytest.fixture(scope="module")
def page(live: LiveService) -> Iterator:
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        tab = browser.new_context(viewport={"width": 1440, "height": 900}).new_page()
        tab.set_default_timeout(30_000)
        errors: list[str] = []
        tab.on("pageerror", lambda err: errors.append(str(err)))
        yield tab
        browser.close()
    assert not errors, f"script errors on the page: {errors}"


def shown_samples(page) -> list[dict]:
    """What the panel shows, read from the DOM: per trajectory its head line, reward and turns."""
    return page.evaluate(
        """() => [...document.querySelectorAll('#samples-list article.sample')].map(a => ({
            head: a.querySelector('.sample-head').textContent,
            reward: a.querySelector('.sample-reward').textContent,
            turns: [...a.querySelectorAll('.turn')].map(t => ({
                role: t.querySelector('.role').textContent,
                content: t.querySelector('pre.content').textContent})),
        }))"""
    )


def assert_panel_shows(page, samples: list[dict]) -> None:
    expect(page.locator("#samples-list article.sample")).to_have_count(len(samples))
    for shown, sample in zip(shown_samples(page), samples, strict=True):
        assert shown["reward"] == f"{sample['reward']:.3f}"
        tokens = sample["tokens"]
        assert f"step {sample['step']}" in shown["head"] and sample["finish_reason"] in shown["head"]
        assert f"{len(sample['turns'])} turn(s)" in shown["head"]
        assert f"trained {tokens['trained']}/{tokens['response']} tokens" in shown["head"]
        expected = [{"role": "prompt", "content": sample["prompt"]}] + sample["turns"]
        assert shown["turns"] == expected


def test_the_panel_shows_the_last_steps_trajectories_turn_by_turn(
    page, live: LiveService, api: httpx.Client, env_job: dict
) -> None:
    samples = api.get(f"/v1/jobs/{env_job['id']}/samples", params={"step": 2}).json()["data"]
    assert len(samples) == SAMPLES
    open_job(page, live, env_job["id"])
    assert_panel_shows(page, samples)  # it follows the job's last step, 2
    for trajectory in shown_samples(page):
        prompt, *turns = trajectory["turns"]
        assert prompt["content"].startswith("system: be brief\nuser: question ")
        # The scripted environment's turns, in its order, between the model's three.
        assert " · done · " in trajectory["head"] and "reward 1.000" in trajectory["head"]
        assert [t["role"] for t in turns] == ["assistant", "tool", "assistant", "user", "assistant"]
        assert [t["content"] for t in turns if t["role"] != "assistant"] == ["t1", "again 2"]


def test_pinning_a_step_shows_that_steps_trajectories(
    page, live: LiveService, api: httpx.Client, env_job: dict
) -> None:
    samples = api.get(f"/v1/jobs/{env_job['id']}/samples", params={"step": 1}).json()["data"]
    assert len(samples) == SAMPLES and all(s["step"] == 1 for s in samples)
    open_job(page, live, env_job["id"])
    page.fill("#samples-step", "1")
    page.dispatch_event("#samples-step", "change")
    expect(page.locator("#samples-list .sample-head").first).to_contain_text("step 1 ")
    assert_panel_shows(page, samples)
    page.fill("#samples-step", "7")  # a step with no samples says so
    page.dispatch_event("#samples-step", "change")
    expect(page.locator("#samples-list")).to_have_text("No samples of step 7.")


def test_a_tinker_sample_without_reward_shows_its_sampler_and_response_tokens(
    page, live: LiveService, api: httpx.Client, env_job: dict
) -> None:
    """A row as the Tinker sampler stores it (service/tinker_sampling.py): no reward, nothing trained."""
    row = {"index": 0, "uid": "smp-1:abc", "prompt": "1 2 3", "sampler": "smp-1", "finish_reason": None,
           "turns": [{"role": "assistant", "content": "4 5"}], "tokens": {"prompt": 3, "response": 2}}  # fmt: skip
    live.service.store.add_samples(env_job["id"], 9, [row])
    open_job(page, live, env_job["id"])
    page.fill("#samples-step", "9")
    page.dispatch_event("#samples-step", "change")
    head = page.locator("#samples-list .sample-head").first
    expect(head).to_contain_text("step 9 ")
    text = head.text_content()
    assert "NaN" not in text and "undefined" not in text and "null" not in text, text
    assert "sampler smp-1" in text and "1 turn(s)" in text and "2 response tokens" in text, text
    assert page.locator("#samples-list .sample-reward").count() == 0
    assert [t["content"] for t in shown_samples_turns(page)] == ["1 2 3", "4 5"]


def shown_samples_turns(page) -> list[dict]:
    return page.evaluate(
        """() => [...document.querySelectorAll('#samples-list article.sample .turn')].map(t => ({
            role: t.querySelector('.role').textContent, content: t.querySelector('pre.content').textContent}))"""
    )
