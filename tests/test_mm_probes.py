"""bench/mm_probes.py: what the product clock counts, when it probes, what it logs, and that removing
it gives aten::mm its own kernel back; bench/tandem_side.py's assignment of probes to steps."""

from __future__ import annotations

import json

import torch

from bench import mm_probes
from bench.tandem_side import probes_per_step


def test_counts_products_probes_every_kth_and_removes_itself(tmp_path):
    log = tmp_path / "probes.jsonl"
    clock = mm_probes.ProductClock(every=3, log=log).install()
    try:
        a, b = torch.randn(8, 5), torch.randn(5, 7)
        for _ in range(7):
            out = a @ b
    finally:
        clock.remove()
    torch.testing.assert_close(out, (a.double() @ b.double()).float())  # still the product
    assert clock.products == 7 and clock.product_flops == 7 * 2 * 8 * 5 * 7
    assert len(clock.rates) == 2 and clock.probe_s > 0  # after the 3rd and the 6th
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [round(line["gflops"] * 1e9, 3) for line in lines] == [round(r, 3) for r in clock.rates]
    assert clock.products == 7  # and once removed, the reference's product was not counted


def test_training_only_counts_autograd_products_not_inference():
    clock = mm_probes.ProductClock(every=1000, training_only=True).install()
    try:
        x = torch.randn(6, 4, requires_grad=True)
        w = torch.randn(3, 4, requires_grad=True)
        with torch.no_grad():
            x @ w.T
        with torch.inference_mode():
            x @ w.T
        assert clock.products == 0
        (x @ w.T).sum().backward()  # forward (grad enabled) and two products in the backward
        assert clock.products == 3
    finally:
        clock.remove()


def test_probes_fall_to_the_step_they_ran_in():
    probes = [{"time": t, "probe_s": 0.1, "gflops": 200.0} for t in (0.5, 1.5, 1.7, 2.0, 3.5)]
    steps = probes_per_step(probes, wall_ends=[1.0, 2.0, 3.0])
    assert [[p["time"] for p in step] for step in steps] == [[0.5], [1.5, 1.7, 2.0], []]
