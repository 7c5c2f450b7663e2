"""Agents through a job's OpenAI-compatible endpoint against calling the rollout engine directly.

One run: a real service (uvicorn on 127.0.0.1, Ray, SQLite) with an external job (rollout.source
external, a step never due, so the engine only serves), then for 1, 8 and 32 concurrent agents
(threads with the `openai` SDK, each making `--requests` chat calls, each call a trajectory of its
own): requests/s and completion tokens/s. The baseline, in the same run: the same model's hf rollout
engine in this process with the job worker's thread count, generating for the same templated prompt
in batches of the concurrency (what perfect batching with no HTTP, templating or recording would
give). One JSON line per concurrency with both and the ratio (goal: >= 0.8 at 32 agents).

    PYTHONPATH=$PWD .venv/bin/python bench/agents.py [--model qwen2-1m-chat] [--requests 4] [--max-tokens 32] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "user", "content": "What is 347*218? Think, then answer."}]


def endpoint_run(live, job: str, agents: int, requests: int, max_tokens: int) -> dict[str, float]:
    from openai import OpenAI

    tokens, errors, lock = [0], [], threading.Lock()

    def agent() -> None:
        client = OpenAI(base_url=f"{live.url}/v1/jobs/{job}/openai/v1", api_key=live.token, max_retries=5)
        for _ in range(requests):
            try:
                out = client.chat.completions.create(model=job, messages=MESSAGES, max_tokens=max_tokens)
            except Exception as err:  # counted and shown, not hidden
                errors.append(repr(err))
                continue
            with lock:
                tokens[0] += out.usage.completion_tokens

    threads = [threading.Thread(target=agent) for _ in range(agents)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done = agents * requests - len(errors)
    return {
        "requests_per_s": done / wall,
        "tokens_per_s": tokens[0] / wall,
        "errors": len(errors),
        "wall_s": wall,
    }


def direct_run(
    engine, prompt: list[int], stop: int, agents: int, requests: int, max_tokens: int
) -> dict[str, float]:
    from engines.rollout import SamplingParams

    params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=[stop])
    tokens, start = 0, time.perf_counter()
    for _ in range(requests):
        tokens += sum(len(c.token_ids) for c in engine.generate([prompt] * agents, params))
    wall = time.perf_counter() - start
    return {"requests_per_s": agents * requests / wall, "tokens_per_s": tokens / wall, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2-1m-chat", help="a built-in chat model")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=4, help="calls per agent")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="2 calls per agent")
    args = parser.parse_args()
    requests = 2 if args.quick else args.requests

    import ray
    from transformers import AutoTokenizer

    from api.server import ray_init
    from controller.models import resolve_model_path
    from controller.spec import ModelSpec
    from engines.rollout import build_rollout_engine
    from engines.threads import limit_threads_for_model
    from tests.api_util import start_service, wait_for
    from workers.chat_serving import ChatRenderer

    home = Path(tempfile.mkdtemp(prefix="tandem-bench-agents-"))
    os.environ["TANDEM_HOME"] = str(home / "home")
    ray_init(num_cpus=8, num_gpus=0, include_dashboard=False, namespace="tandem-bench", logging_level="warning",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}})  # fmt: skip
    live = start_service(home / "service")
    try:
        spec = {
            "method": "grpo", "model": {"builtin": args.model},
            "rollout": {"source": "external", "free_cache_after_generate": False,
                        "external": {"group_size": 1, "trajectories_per_step": 1 << 16, "max_pending": 1 << 20}},
            "trainer": {"total_steps": 1, "val_every": 0}, "checkpoint": {"every": 0},
        }  # fmt: skip
        with live.client() as api:
            job = api.post("/v1/jobs", json=spec).json()["id"]
            wait_for(api, job, ("running",), timeout_s=300)
            endpoint_run(live, job, 1, 2, args.max_tokens)  # warm: the endpoint is up, the engine has run
            path = resolve_model_path(ModelSpec(builtin=args.model))
            threads = limit_threads_for_model(path)  # what the job's rollout worker uses
            engine = build_rollout_engine("hf", path, device="cpu")
            renderer = ChatRenderer(AutoTokenizer.from_pretrained(path))
            prompt = renderer.prompt_ids(MESSAGES)
            direct_run(engine, prompt, renderer.turn_end_id, 1, 1, args.max_tokens)  # warm
            for agents in args.concurrency:
                direct = direct_run(engine, prompt, renderer.turn_end_id, agents, requests, args.max_tokens)
                served = endpoint_run(live, job, agents, requests, args.max_tokens)
                print(json.dumps({
                    "bench": "agents", "model": args.model, "agents": agents, "requests_per_agent": requests,
                    "max_tokens": args.max_tokens, "threads": threads, "endpoint": served, "direct": direct,
                    "tokens_per_s_ratio": served["tokens_per_s"] / direct["tokens_per_s"],
                    "load_avg_1m": os.getloadavg()[0],
                }), flush=True)  # fmt: skip
            api.post(f"/v1/jobs/{job}/cancel")
    finally:
        live.stop()
        ray.shutdown()


if __name__ == "__main__":
    main()
