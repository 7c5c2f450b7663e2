"""engines/host_memory.py: with freed memory kept, a training step's tensors reuse pages already
mapped; without it, glibc maps and unmaps many of them again every step. Each case runs in its
own interpreter, since the setting is process-wide and cannot be undone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engines.host_memory import malloc_tunables, transparent_huge_pages

ROOT = Path(__file__).resolve().parents[1]

# A small MLP's forward and backward on batches of varying length (as a training step's packed
# rows vary), then a 200 MB temporary (SmolLM2-135M's kept log-softmax of a micro-batch's 1024
# response tokens is 201 MB: above glibc's largest automatic threshold, 32 MiB, and the 128 MiB one
# this module set until 2026-11-27, so every one was mapped afresh), 20 times after a warm-up; the
# minor page faults per round.
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
    torch.ones(50_000_000).sum()
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
    # 50,000,000 floats are 48,829 pages: by default each round maps them afresh (and the MLP's
    # 0.5-1.6 MiB activations some of the time: 200-900 faults a round, measured); kept, the heap
    # reuses them (30-120 faults a round before the temporary was added).
    assert default["faults_per_round"] > 48_000
    assert kept["faults_per_round"] < 1_000


def test_malloc_tunables_add_huge_pages_and_keep_what_the_user_set():
    assert malloc_tunables(None) == "glibc.malloc.hugetlb=1"
    assert malloc_tunables("") == "glibc.malloc.hugetlb=1"
    assert malloc_tunables("glibc.malloc.arena_max=2") == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert malloc_tunables("glibc.malloc.hugetlb=0") == "glibc.malloc.hugetlb=0"  # the user's opt-out
    assert malloc_tunables("glibc.malloc.hugetlb=2:x=1") == "glibc.malloc.hugetlb=2:x=1"


# A 256 MiB block touched once: above any mmap threshold, so malloc maps it afresh.
FRESH_BLOCK = """
import json, resource, torch
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(64 << 20).sum()
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


@pytest.mark.skipif(
    transparent_huge_pages() != "madvise",
    reason="the tunable matters where the kernel gives huge pages on request ('madvise')",
)
def test_the_tunable_maps_a_fresh_block_in_huge_pages():
    def faults(env: dict[str, str]) -> int:
        done = subprocess.run([sys.executable, "-c", FRESH_BLOCK], capture_output=True, text=True,
                              timeout=120, env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])["faults"]

    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    default = faults(base)
    huge = faults({**base, "GLIBC_TUNABLES": malloc_tunables(None)})
    assert default > 60_000  # 65,536 pages of 4 KiB
    assert huge < 2_000  # 128 pages of 2 MiB (and the interpreter's own)
