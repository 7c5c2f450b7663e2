"""What the machine can do, and how much of it a GRPO step's phases use (model FLOPs utilisation).

`machine_peak` measures, in the calling process, the two numbers a phase is held against: the
FLOP/s of an fp32 2048 x 2048 matrix product at the given torch thread count (the best of a few
repeats: the attainable peak), and the bytes/s of reading a 512 MB fp32 tensor (the memory
bandwidth that bounds decoding, which reads every weight once per token).

`phase_utilisation` turns a Tandem step's medians (timing_s/*, prompt and response lengths, the
share of rows without advantage) into achieved FLOP/s per phase:

- update: 2 FLOPs per weight per token forward; backward 4 (input and weight gradients) for full
  fine-tuning, 2 for LoRA (the frozen base needs input gradients only). The decoder body runs over
  each group's prompt once (engines/kernels/shared_prompt.py) plus every response token; the vocabulary
  projection over the response tokens only. Rows without advantage run forward only.
- generation: 2 FLOPs per weight per token (each group's prompt prefilled once, as the hf engine
  does, + every generated token; the vocabulary projection for generated tokens only), plus the weights read once per decode step. Its bound is
  compute time + read time at the measured peaks (the issue's arithmetic; the two can overlap, so
  this bound is the looser of the two ways to add them).
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path


def machine_peak(threads: int, repeats: int = 5) -> dict[str, float]:
    """fp32 matmul FLOP/s (2048^3 product, best of `repeats`) and read bandwidth in bytes/s."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
        a @ b  # warm-up
        best = min(_seconds(lambda: a @ b) for _ in range(repeats))
        big = torch.ones(128 * 1024 * 1024)  # 512 MB
        big.sum()
        read = min(_seconds(big.sum) for _ in range(repeats))
    finally:
        torch.set_num_threads(before)
    return {
        "matmul_flops": 2 * 2048**3 / best,
        "read_bytes_per_s": big.numel() * 4 / read,
        "threads": threads,
    }


def cuda_peak(repeats: int = 5) -> dict[str, float]:
    """bf16 matmul FLOP/s (8192^3 product, best of `repeats`) and read bandwidth (a 2 GiB bf16 tensor
    summed) on the current CUDA device: what a GPU phase is held against."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    big = torch.ones(1024**3, device="cuda", dtype=torch.bfloat16)

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    matmul = min(timed(partial(torch.matmul, a, b)) for _ in range(repeats))
    read = min(timed(big.sum) for _ in range(repeats))
    del a, b, big
    torch.cuda.empty_cache()
    return {"matmul_flops": 2 * 8192**3 / matmul, "read_bytes_per_s": 2 * 1024**3 / read, "dtype": "bf16"}


def sustained_matmul_flops(threads: int, seconds: float = 2.0) -> float:
    """fp32 FLOP/s of back-to-back 2048^3 products for about `seconds`: the median product's rate.

    The burst peak (`machine_peak`, best of five ~50 ms products) is what the cores reach for an
    instant; an update runs for seconds. On a shared host the two differ (on 2026-11-26's AVX-512
    host bursts read 185-322 GFLOP/s within the hour), so a utilisation measured against a loop of
    this, taken right before and after the timed work, says how much of the machine the work got
    while it ran."""
    import statistics

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
        a @ b  # warm-up
        rates, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end or len(rates) < 3:
            rates.append(2 * 2048**3 / _seconds(lambda: a @ b))
    finally:
        torch.set_num_threads(before)
    return statistics.median(rates)


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def model_shape(model_dir: str | Path) -> dict[str, int]:
    """Weights of the decoder body and of the vocabulary projection, and the fp32 bytes read per token."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    from safetensors import safe_open

    total = 0
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        for key in f.keys():
            numel = 1
            for size in f.get_slice(key).get_shape():
                numel *= size
            total += numel
    head = config["vocab_size"] * config["hidden_size"]
    tied = config.get("tie_word_embeddings", False)
    body = total - head if tied else total - 2 * head  # the embedding lookup costs no FLOPs
    return {"body_params": body, "head_params": head, "weight_bytes": 4 * (body + head)}


def update_flops(
    shape: dict[str, int], prompt_tokens: float, response_tokens: float, with_grad: float = 1.0,
    lora: bool = False,
) -> tuple[float, float]:  # fmt: skip
    """(forward, backward) FLOPs of an update: the body over the prompts (each once) and responses,
    the head over the responses; backward only for the `with_grad` share of rows."""
    body, head = shape["body_params"], shape["head_params"]
    tokens = body * (prompt_tokens + response_tokens) + head * response_tokens
    return 2 * tokens, (2 if lora else 4) * with_grad * tokens


def phase_utilisation(
    medians: dict[str, float], shape: dict[str, int], peak: dict[str, float], prompts: int, n: int,
    new_tokens: int, lora: bool = False,
) -> dict[str, float]:  # fmt: skip
    """Achieved FLOP/s of the update and generation, and their fractions of the measured peaks."""
    rows = prompts * n
    response = medians.get("response_length/mean", new_tokens) * rows
    prompt_once = medians.get("prompt_length/mean", 0.0) * prompts
    with_grad = 1.0 - medians.get("critic/advantages/zero_rows", 0.0)
    forward, backward = update_flops(shape, prompt_once, response, with_grad, lora)
    body, head = shape["body_params"], shape["head_params"]
    out: dict[str, float] = {"peak_matmul_gflops": peak["matmul_flops"] / 1e9}
    out["peak_read_gb_per_s"] = peak["read_bytes_per_s"] / 1e9
    update_s = medians.get("timing_s/update_actor")
    if update_s:
        out["update_tflop"] = (forward + backward) / 1e12
        out["update_gflops"] = (forward + backward) / update_s / 1e9
        out["update_mfu"] = (forward + backward) / update_s / peak["matmul_flops"]
    gen_s = medians.get("timing_s/gen")
    if gen_s:
        gen_flops = 2 * body * (prompt_once + response) + 2 * head * response  # prefill once per group
        compute_s = gen_flops / peak["matmul_flops"]
        read_s = new_tokens * shape["weight_bytes"] / peak["read_bytes_per_s"]
        out.update(gen_tflop=gen_flops / 1e12, gen_gflops=gen_flops / gen_s / 1e9)
        out.update(gen_bound_s=compute_s + read_s, gen_of_bound=(compute_s + read_s) / gen_s)
        out["gen_mfu"] = gen_flops / gen_s / peak["matmul_flops"]
    return {k: round(v, 4) for k, v in out.items()}
