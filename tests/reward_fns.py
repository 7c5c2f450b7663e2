"""Reward functions the tests submit by reference ('tests.reward_fns:NAME'): a light module, so the
API's check of a reference (it imports the module in a child process) does not import torch."""

from __future__ import annotations


def digit_reward(prompt: str, response: str, ground_truth, extra) -> dict:
    """A reward a random tiny model already earns sometimes (so advantages are not all zero)."""
    digits = sum(ch.isdigit() for ch in response)
    return {"score": digits / max(len(response), 1), "digits": float(digits)}
