"""Ends its process on import, bypassing every handler."""

import os

os._exit(3)


def score(prompt, response, ground_truth, extra):
    return 0.0
