"""Agents through a job's OpenAI-compatible endpoint against calling the rollout engine directly.

One run: a real service (uvicorn on 127.0.0.1, Ray, SQLite) with an external job (rollout.source
external, a step never due, so the engine only serves), then for 1, 8 and 32 concurrent agents
(threads with the `openai` SDK, each making `--requests` chat calls, each call a trajectory of its
own; the agents run in a process of their own): requests/s and completion tokens/s. The baseline,
interleaved with it round by round: the same rollout worker's engine called directly over Ray with
the same templated prompt in batches of the concurrency (what perfect batching with no HTTP, API,
templating or recording would give). One JSON line per concurrency with the best round of each and
the ratio (goal: >= 0.8 of the direct tokens/s at 32 agents).

    PYTHONPATH=$PWD .venv/bin/python bench/agents.py [--model qwen2-1m-chat] [--requests 4] [--max-tokens 32] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
MESSAGES = [{"role": "user", "content": "What is 347*218? Think, then answer."}]


def endpoint_run(live, job: str, agents: int, requests: int, max_tokens: int) -> dict[str, float]:
    """The agents run in a process of their own (as they would on their own machine): here they would
    share the API server's interpreter lock."""
    args = [
        sys.executable,
        __file__,
        "--client",
        live.url,
        job,
        live.token,
        str(agents),
        str(requests),
        str(max_tokens),
    ]
    out = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=REPO, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def agents_client(
    url: str, job: str, token: str, agents: int, requests: int, max_tokens: int
) -> dict[str, float]:
    from openai import OpenAI

    tokens, errors, lock = [0], [], threading.Lock()

    def agent() -> None:
        client = OpenAI(base_url=f"{url}/v1/jobs/{job}/openai/v1", api_key=token, max_retries=5)
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


def direct_run(host, prompt: list[int], stop: int, agents: int, requests: int, max_tokens: int) -> dict:
    """The same rollout worker's engine, called with the whole batch at once (no HTTP, API, templating,
    batching window or recording)."""
    import ray

    params = {"max_new_tokens": max_tokens, "stop_token_ids": [stop]}
    tokens, start = 0, time.perf_counter()
    for _ in range(requests):
        out = ray.get(host.execute.remote("generate", (([prompt] * agents, params), {})), timeout=900)
        tokens += sum(len(c.token_ids) for c in out)
    wall = time.perf_counter() - start
    return {"requests_per_s": agents * requests / wall, "tokens_per_s": tokens / wall, "wall_s": wall}


def best(runs: list[dict[str, float]]) -> dict[str, float]:
    """The round with the most tokens/s (the machine is shared: the least disturbed round)."""
    return max(runs, key=lambda r: r["tokens_per_s"])


def chat_model(name: str, root: Path) -> Path:
    """The built-in model `name`'s shape and weights with the chat template, as a model folder."""
    from engines.models.tiny_models import BUILTIN_MODELS, build_tiny_model

    spec = BUILTIN_MODELS[name].model_copy(update={"chat_template": True})
    return build_tiny_model(root / f"{name}-chat", spec)


def main() -> None:
    if sys.argv[1:2] == ["--client"]:  # the agents' process (endpoint_run)
        url, job, token, agents, requests, max_tokens = sys.argv[2:8]
        print(json.dumps(agents_client(url, job, token, int(agents), int(requests), int(max_tokens))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="qwen2-1m-chat",
        help="a built-in model's shape (given the chat template if it has none)",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=4, help="calls per agent")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--window-ms", type=float, default=None, help="rollout.external.batch_window_ms")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the best of each is kept")
    parser.add_argument("--quick", action="store_true", help="2 calls per agent, 2 rounds")
    args = parser.parse_args()
    requests = 2 if args.quick else args.requests
    args.rounds = 2 if args.quick else args.rounds

    import ray
    from transformers import AutoTokenizer

    from api.server import ray_init
    from api.settings import ServeSettings
    from schema.external import server_name
    from tests.api_util import start_service, wait_for
    from workers.chat_serving import ChatRenderer

    home = Path(tempfile.mkdtemp(prefix="tandem-bench-agents-"))
    os.environ["TANDEM_HOME"] = str(home / "home")
    ray_init(num_cpus=8, num_gpus=0, include_dashboard=False, namespace="tandem-bench", logging_level="warning",
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}})  # fmt: skip
    path = chat_model(args.model, home / "models")
    live = start_service(home / "service", settings=ServeSettings(allowed_paths=[home / "models"]))
    try:
        spec = {
            "method": "grpo", "model": {"path": str(path)},
            "rollout": {"source": "external", "free_cache_after_generate": False,
                        "external": {"group_size": 1, "trajectories_per_step": 1 << 16, "max_pending": 1 << 20,
                                     **({} if args.window_ms is None else {"batch_window_ms": args.window_ms})}},
            "trainer": {"total_steps": 1, "val_every": 0}, "checkpoint": {"every": 0},
        }  # fmt: skip
        with live.client() as api:
            job = api.post("/v1/jobs", json=spec).json()["id"]
            wait_for(api, job, ("running",), timeout_s=300)
            deadline = time.time() + 300
            while api.get(f"/v1/jobs/{job}/trajectories/probe").status_code != 404:  # 503 until it serves
                if time.time() > deadline:
                    raise RuntimeError("the job's endpoint did not come up within 300 s")
                time.sleep(0.5)
            endpoint_run(live, job, 1, 2, args.max_tokens)  # warm: the endpoint is up, the engine has run
            server = ray.get_actor(server_name(job))
            hosts = ray.get(server.replicas.remote(), timeout=60)
            renderer = ChatRenderer(AutoTokenizer.from_pretrained(path))
            prompt, stop = renderer.prompt_ids(MESSAGES), renderer.turn_end_id
            for agents in args.concurrency:
                direct, served = [], []
                for _ in range(args.rounds):  # interleaved, so both see the same load
                    direct.append(direct_run(hosts[0], prompt, stop, agents, requests, args.max_tokens))
                    served.append(endpoint_run(live, job, agents, requests, args.max_tokens))
                d, e = best(direct), best(served)
                print(json.dumps({
                    "bench": "agents", "model": args.model, "agents": agents, "requests_per_agent": requests,
                    "max_tokens": args.max_tokens, "rounds": args.rounds, "batch_window_ms": args.window_ms or 250.0, "endpoint": e, "direct": d,
                    "tokens_per_s_ratio": e["tokens_per_s"] / d["tokens_per_s"],
                    "requests_per_s_ratio": e["requests_per_s"] / d["requests_per_s"],
                    "load_avg_1m": os.getloadavg()[0],
                }), flush=True)  # fmt: skip
            api.post(f"/v1/jobs/{job}/cancel")
    finally:
        live.stop()
        ray.shutdown()


if __name__ == "__main__":
    main()
