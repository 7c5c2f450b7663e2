"""One printed form per kind of number (controller/metric_format.py), as the CLI and the logs print it."""

from __future__ import annotations

from api.cli_watch import summary
from controller.metric_format import format_metric, format_metrics


def test_scores_rewards_and_accuracies_have_three_decimals_whatever_their_value() -> None:
    for key in ("val/accuracy", "critic/score/mean", "reward/exact/mean", "critic/rewards/max"):
        assert [format_metric(key, v) for v in (1, 0, 0.2375, 0.01406)] == [
            "1.000",
            "0.000",
            "0.237",
            "0.014",
        ]


def test_other_metrics_have_four_significant_digits_and_counts_stay_counts() -> None:
    assert format_metric("sft/loss", 0.29181) == "0.2918"
    assert format_metric("actor/lr", 0.0015) == "0.0015"
    assert format_metric("timing_s/step", 12.3456) == "12.35"
    assert format_metric("reward/errors", 3.0) == "3"  # a count, though it sits under reward/
    assert format_metric("actor/reward_kl_penalty", 0.001234) == "0.001234"
    assert format_metric("val/accuracy", None) == "-"
    assert format_metrics({"critic/score/mean": 0.25, "timing_s/step": 0.0581}) == (
        "critic/score/mean=0.250, timing_s/step=0.0581"
    )


def test_a_finished_jobs_line_prints_an_accuracy_of_one_as_1_000() -> None:
    job = {"id": "job-1", "status": "succeeded", "step": 3, "total_steps": 3, "error": None, "outputs": {},
           "latest_metrics": {"critic/score/mean": 0.99812, "val/accuracy": 1}}  # fmt: skip
    assert summary(job) == "job job-1 succeeded at step 3/3 (reward 0.998, val accuracy 1.000)"
