"""A reward function that kills, exits or hangs its sandbox on one sample: that sample fails, named
with its error, the others of its batch are scored, and a new sandbox takes over."""

from __future__ import annotations

import time

import pytest

from controller.rewards import RETRY_FAILURES, RewardScorer

FAULTY = """
import ctypes, os, sys, threading, time

def flood():
    for _ in range(200):
        print("spam " * 10_000)

def score(prompt, response, ground_truth, extra):
    if response == "flood":  # 10 MB after the call returned, 6 MB in it, on both streams
        threading.Thread(target=flood, daemon=True).start()
        sys.stdout.write("x" * 3_000_000)
        os.write(2, b"y" * 3_000_000)
    if response == "exit":
        sys.exit(3)
    if response == "interrupt":
        raise KeyboardInterrupt("stop")
    if response == "_exit":
        os._exit(7)
    if response == "segv":
        ctypes.string_at(0)
    if response == "sleep":
        time.sleep(600)
    return float(len(response))
"""


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    path = tmp_path_factory.mktemp("faulty") / "faulty_rewards.py"
    path.write_text(FAULTY)
    path.parent.chmod(0o755)
    return f"{path}:score"


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("exit", "SystemExit: 3"),
        ("interrupt", "KeyboardInterrupt: stop"),
        ("_exit", "reward sandbox 0 failed: the sandbox's process ended (exit code 7)"),
        ("segv", "reward sandbox 0 failed: the sandbox's process ended on signal SIGSEGV"),
        ("sleep", "reward sandbox 0 did not finish within 3 s"),
    ],
)
def test_one_sample_that_exits_kills_or_hangs_its_sandbox_fails_alone(faulty, fault, message):
    with RewardScorer(faulty, timeout_s=3) as scorer:
        result = scorer.score(["p"] * 4, ["a", "bb", fault, "ccc"], [None] * 4)
        after = scorer.score(["p"], ["dddd"], [None])  # the sandbox (a new one, if it died) goes on
    assert result.scores.tolist() == [1.0, 2.0, 0.0, 3.0]
    assert result.errors == 1 and result.row_errors[:2] == [None, None] and result.row_errors[3] is None
    assert message in result.row_errors[2] and result.error_messages[0].startswith("sample 2: ")
    assert after.scores.tolist() == [4.0]


def test_a_function_that_crashes_on_every_sample_gives_up_after_a_few_restarts(faulty):
    started = time.monotonic()
    with RewardScorer(faulty, timeout_s=30) as scorer:
        result = scorer.score(["p"] * 20, ["_exit"] * 20, [None] * 20)
    assert result.scores.tolist() == [0.0] * 20 and result.errors == 20
    assert all("exit code 7" in e for e in result.row_errors[:RETRY_FAILURES])
    assert all(
        e.startswith("not scored: reward sandbox 0 failed on") for e in result.row_errors[RETRY_FAILURES:]
    )
    assert time.monotonic() - started < 30  # a restart per failed row, a few of them: not one per row


def test_what_the_function_prints_reaches_the_log_bounded(faulty, capfd):
    with RewardScorer(faulty, timeout_s=30) as scorer:
        result = scorer.score(["p"] * 3, ["a", "flood", "bb"], [None] * 3)
        time.sleep(2)  # the thread goes on printing after the call returned
        again = scorer.score(["p"], ["ccc"], [None])
    assert result.scores.tolist() == [1.0, 5.0, 2.0] and again.scores.tolist() == [3.0]
    out, err = capfd.readouterr()
    assert len(out) + len(err) < 2 * 1024 * 1024 and "[sandbox output past 1 MiB dropped]" in err
