"""bench/vs_trl.py's command line: the CUDA path's flags parse, the in-process-only levers are refused
with the served side, and the Tandem job it submits is a valid JobSpec."""

from __future__ import annotations

import argparse

import pytest

from bench import vs_trl
from bench.tandem_side import tandem_spec
from schema.job import JobSpec


def test_several_token_counts_parse_and_the_in_process_levers_are_refused_when_served(capsys):
    assert vs_trl.token_counts("64,256") == [64, 256]
    for argv in (["--device", "cuda", "--lora"], ["--served", "--probe-every", "4"]):
        with pytest.raises(SystemExit):
            vs_trl.main(argv)
        assert "in-process Tandem side only" in capsys.readouterr().err


def test_the_submitted_job_is_a_valid_spec_with_the_levers_applied():
    args = argparse.Namespace(
        model_dir="/models/m", train="/data/train.jsonl", reward="digits", steps=4, prompts=16, n=8,
        max_new_tokens=256, lr=1e-4, lora=False, tandem_set=["rollout.backend=hf", "resources.workers=2"],
    )  # fmt: skip
    spec = JobSpec.model_validate(tandem_spec(args))
    assert spec.rollout.max_new_tokens == 256 and spec.rollout.n == 8
    assert spec.rollout.backend == "hf" and spec.resources.workers == 2
    assert spec.reward.function.endswith("vs_trl_task.py:digit_share")
