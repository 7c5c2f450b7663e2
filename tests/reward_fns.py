"""Reward functions the tests submit by reference ('tests.reward_fns:NAME'): a light module, so the
API's check of a reference (it imports the module in a child process) does not import torch."""

from __future__ import annotations


def digit_reward(prompt: str, response: str, ground_truth, extra) -> dict:
    """A reward a random tiny model already earns sometimes (so advantages are not all zero)."""
    digits = sum(ch.isdigit() for ch in response)
    return {"score": digits / max(len(response), 1), "digits": float(digits)}


def paced_digit_reward(prompt: str, response: str, ground_truth, extra) -> dict:
    """digit_reward, 25 ms a row: a 16-row step takes at least 0.4 s however fast the engines get, so a
    test that acts between two step boundaries has seconds to do it."""
    import time

    time.sleep(0.025)
    return digit_reward(prompt, response, ground_truth, extra)


def slow_paced_digit_reward(prompt: str, response: str, ground_truth, extra) -> dict:
    """digit_reward, 100 ms a row: a 16-row step takes at least 1.6 s (a job that must still be running
    while another, slower to start, takes its first steps)."""
    import time

    time.sleep(0.1)
    return digit_reward(prompt, response, ground_truth, extra)
