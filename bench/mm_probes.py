"""2048^3 probes among a process's own matrix products: the machine's product rate at the moments an
update runs, to rate the update against.

On a shared host the rate of a loop of 2048^3 products moved from 138 to 252 GFLOP/s within a minute
(bench/RESULTS.md, issue 34), so loops before and after an update can miss the rate the update itself
met. `ProductClock` overrides the CPU kernel of aten::mm (through a `torch.library` registration,
removed again by `remove`) with one that times each product (aten::mm.out, the same kernel) and runs
one 2048^3 product, timed apart, after every `every`-th: the probes sample the machine while the
update runs, and their seconds can be taken out of its time. Python runs once a product, not once
an operation. With `training_only` only products of a training step count: under autograd (grad
enabled, or inside a backward); a rollout engine's products under no_grad or inference_mode do not.

In a job (`bench/vs_trl.py --probe-every K`) the ranks get it through Ray's worker process setup
hook, `install`, which reads `TANDEM_BENCH_MM_PROBES` ("K:folder") and writes one JSON line a probe
(`time` since the epoch, `probe_s`, `gflops`) to `folder/<pid>.jsonl`.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

import torch

ENV = "TANDEM_BENCH_MM_PROBES"
SIZE = 2048


class ProductClock:
    """Times aten::mm on the CPU and probes the machine's product rate among the products."""

    def __init__(self, every: int, training_only: bool = False, log: Path | None = None) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every, self.training_only, self.log = every, training_only, log
        self.a, self.b = torch.randn(SIZE, SIZE), torch.randn(SIZE, SIZE)
        self.library: torch.library.Library | None = None
        self._log_file = None
        self.reset()

    def reset(self) -> None:
        self.products, self.product_s, self.product_flops = 0, 0.0, 0.0
        self.probe_s, self.rates = 0.0, []

    def install(self) -> ProductClock:
        self.library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": meant
            self.library.impl("mm", self._mm, "CPU")
        return self

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()  # aten::mm's own CPU kernel again
            self.library = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def _mm(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = x.new_empty((x.shape[0], y.shape[1]))
        counted = not self.training_only or torch.is_grad_enabled() or torch._C._current_graph_task_id() >= 0
        start = time.perf_counter()
        torch.ops.aten.mm.out(x, y, out=out)
        if not counted:
            return out
        self.product_s += time.perf_counter() - start
        self.product_flops += 2 * x.shape[0] * x.shape[1] * y.shape[1]
        self.products += 1
        if self.products % self.every == 0:
            self._probe()
        return out

    def _probe(self) -> None:
        probe = self.a.new_empty((SIZE, SIZE))
        start = time.perf_counter()
        torch.ops.aten.mm.out(self.a, self.b, out=probe)
        seconds = time.perf_counter() - start
        rate = 2 * SIZE**3 / seconds
        self.probe_s += seconds
        self.rates.append(rate)
        if self.log is not None:
            if self._log_file is None:  # opened once, a line flushed at a time
                self._log_file = self.log.open("a", buffering=1)
            line = {"time": time.time(), "probe_s": seconds, "gflops": rate / 1e9}
            self._log_file.write(json.dumps(line) + "\n")


def install() -> None:
    """Ray's worker_process_setup_hook: a training-only ProductClock in this worker process where
    TANDEM_BENCH_MM_PROBES is set ("every:folder")."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    every, folder = spec.split(":", 1)
    log = Path(folder) / f"{os.getpid()}.jsonl"
    global _CLOCK  # kept for the process's life: its registration lives as long as it does
    _CLOCK = ProductClock(int(every), training_only=True, log=log).install()


def read_probes(folder: Path) -> list[dict]:
    """Every probe the processes logged under `folder`, by time."""
    lines = [json.loads(line) for path in folder.glob("*.jsonl") for line in path.read_text().splitlines()]
    return sorted(lines, key=lambda line: line["time"])


_CLOCK: ProductClock | None = None
