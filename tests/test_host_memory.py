"""engines/host_memory.py: with freed memory kept, a training step's tensors reuse pages already
mapped; without it, glibc maps and unmaps many of them again every step. Each case runs in its
own interpreter, since the setting is process-wide and cannot be undone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A small MLP's forward and backward on batches of varying length (as a training step's packed
# rows vary), then a 48 MB temporary (a real model's head gradient is 113 MB: above glibc's largest
# automatic threshold, 32 MiB, so by default every one is mapped afresh), 20 times after a warm-up;
# the minor page faults per round.
PROGRAM = """
import json, sys
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
from engines.host_memory import keep_freed_memory, minor_page_faults
kept = keep_freed_memory() if {keep} else None
blocks = [[torch.nn.Linear(128, 384), torch.nn.SiLU(), torch.nn.Linear(384, 128)] for _ in range(4)]
model = torch.nn.Sequential(*[layer for block in blocks for layer in block])
def round_(i):
    model(torch.randn(1000 + 17 * (i % 7), 128)).square().mean().backward()
    torch.ones(12_000_000).sum()
for i in range(5):
    round_(i)
before = minor_page_faults()
for i in range(20):
    round_(i)
print(json.dumps({{"kept": kept, "faults_per_round": (minor_page_faults() - before) / 20}}))
"""


def faults_per_round(keep: bool) -> dict:
    code = PROGRAM.format(root=str(ROOT), keep=keep)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_kept_memory_maps_no_new_pages_per_step():
    default, kept = faults_per_round(False), faults_per_round(True)
    assert kept["kept"] is True
    # 12,000,000 floats are 11,719 pages: by default each round maps them afresh (and the MLP's
    # 0.5-1.6 MiB activations some of the time: 200-900 faults a round, measured); kept, the heap
    # reuses them (30-120 faults a round before the 48 MB temporary was added).
    assert default["faults_per_round"] > 11_000
    assert kept["faults_per_round"] < 1_000
