"""Sleeps forever on import: a check must time out."""

import time

time.sleep(3600)


def score(prompt, response, ground_truth, extra):
    return 0.0
