"""Imports fine, hangs when it scores."""

import time


def score(prompt, response, ground_truth, extra):
    time.sleep(3600)
    return 0.0
