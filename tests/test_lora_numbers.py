"""A LoRA GRPO job's numbers, pinned: the per-step loss, KL, entropy, gradient norm and rewards of a
short seeded job (colocated, one rank, tiny-qwen2, fp32), and the texts it sampled.

The values were recorded on the code whose LoRA layers were PEFT's; the job must give them to 1e-5
(the texts exactly) on whatever LoRA layer the engine uses. The job reaches every part of that layer:
all-linear adapters initialised from the seed, dropout on their input, the reference policy as the
same model with its adapters off (the KL loss), and the adapter's sync into the hf rollout engine
each step (sampling at temperature 1 follows the trained adapter, so steps 2 and 3 sample from it).
"""

from __future__ import annotations

import json

import pytest

from tests.test_placement import run_job
from tests.test_trainer import job_spec

TOL = 1e-5
SPEC = {
    "model": {"builtin": "tiny-qwen2", "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.1}},
    "algorithm": {"use_kl_loss": True, "kl_loss_coef": 0.05},
    "optim": {"lr": 3e-2},
    "rollout": {"n": 4, "max_new_tokens": 4, "temperature": 1.0},
    "trainer": {"total_steps": 3, "prompts_per_step": 4, "val_every": 0, "seed": 3},
    "checkpoint": {"every": 0, "export_hf": False},
    "resources": {"workers": 1},
}
EXPECTED = [
    {
        "actor/loss": 0.0,
        "actor/kl_loss": 0.0,
        "actor/entropy": 4.59218168258667,
        "actor/grad_norm": 0.2906457483768463,
        "critic/score/mean": 0.109375,
    },
    {
        "actor/loss": 0.0002994184324052185,
        "actor/kl_loss": 0.0059883687645196915,
        "actor/entropy": 4.59060001373291,
        "actor/grad_norm": 0.18980781733989716,
        "critic/score/mean": 0.078125,
    },
    {
        "actor/loss": 0.0011111738858744502,
        "actor/kl_loss": 0.022223327308893204,
        "actor/entropy": 4.584576606750488,
        "actor/grad_norm": 0.2576436400413513,
        "critic/score/mean": 0.1145833358168602,
    },
]
# The stored samples of each step (samples.jsonl keeps the first prompt's group).
EXPECTED_TEXTS = [
    ["q'B.", "S4|]", "P;Z)", "|G6%"],
    ["<XYj", "'ilU", "E%?V", "?`D{"],
    ["#^\\g", "Xzdz", "cEn9", "&YFd"],
]


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))


def test_a_lora_jobs_losses_and_rewards_are_the_recorded_ones(ray_cluster, tmp_path):
    sink = run_job(job_spec(**SPEC), tmp_path / "job")
    assert [row["step"] for row in sink.history] == [1, 2, 3]
    for row, want in zip(sink.history, EXPECTED, strict=True):
        for key, value in want.items():
            assert row["values"][key] == pytest.approx(value, abs=TOL, rel=0), (row["step"], key)
    rows = [json.loads(line) for line in (sink.folder / "samples.jsonl").read_text().splitlines()]
    texts = [[turn["content"] for s in row["samples"] for turn in s["turns"]] for row in rows]
    assert texts == EXPECTED_TEXTS
