"""An agent written with the plain `openai` SDK that a Tandem job trains on (rollout.source: external).

It solves the built-in calculator task ("347*218=") with one tool, `calculator`: the model may call
it, the agent evaluates the expression and sends the result back, and the model's final answer is
scored 1 when its leading integer is right. Nothing in it knows Tandem except two URLs: the
trajectory's base URL (every call through it is recorded token-exact in that trajectory) and the
reward it posts at the end. Run it against a job submitted with examples/agent_openai.yaml:

    tandem submit examples/agent_openai.yaml          # prints the job id
    python examples/agent_openai.py --url http://127.0.0.1:8000 --job JOB_ID --key "$(cat ~/.tandem/admin_token)"

`--reward digits` scores the share of digits in the answer instead: a shaped reward that a tiny model
learns from random weights in a few steps (the tests use it).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import uuid

import httpx
from openai import OpenAI

from controller.tasks import get_task
from controller.tasks.calculator import CALCULATOR_TOOL
from workers.environments.calculator import CalculatorError, evaluate

# One function tool, `calculator(expression)`. The SFT warm start of examples/agent_openai.yaml
# teaches the built-in chat model to call it (controller/tasks/calculator.py writes its traces).
TOOLS = [CALCULATOR_TOOL]


def score(answer: str, truth: str, reward: str) -> float:
    if reward == "digits":
        return sum(ch.isdigit() for ch in answer) / max(len(answer), 1)
    found = re.search(r"-?\d+", answer)
    return float(found is not None and found.group(0) == truth)


def run_tool(call) -> str:
    try:
        return str(evaluate(json.loads(call.function.arguments)["expression"]))
    except (CalculatorError, ValueError, KeyError, TypeError) as err:
        return f"error: {err}"


def solve(url: str, job: str, key: str, problem: dict, group: str, args: argparse.Namespace) -> float:
    """One trajectory: chat with the tool until a final answer (or max_turns), then post the reward."""
    trajectory = f"{group}-{uuid.uuid4().hex[:8]}"
    client = OpenAI(
        base_url=f"{url}/v1/jobs/{job}/openai/trajectories/{trajectory}/v1", api_key=key, max_retries=30
    )
    messages = [{"role": "user", "content": problem["prompt"]}]
    answer = ""
    limit = {} if args.max_tokens is None else {"max_tokens": args.max_tokens}
    for _ in range(args.max_turns):
        reply = (
            client.chat.completions.create(model=job, messages=messages, tools=TOOLS, **limit)
            .choices[0]
            .message
        )
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            answer = reply.content or ""
            break
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    reward = score(answer, problem["ground_truth"], args.reward)
    headers = {"Authorization": f"Bearer {key}"}
    posted = httpx.post(f"{url}/v1/jobs/{job}/trajectories/{trajectory}/reward", headers=headers,
                        json={"reward": reward, "task_id": group}, timeout=60)  # fmt: skip
    posted.raise_for_status()
    return reward


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the Tandem service, e.g. http://127.0.0.1:8000")
    parser.add_argument("--job", required=True)
    parser.add_argument("--key", required=True, help="a Tandem API key")
    parser.add_argument("--task", default="calculator", help="a built-in task (controller/tasks)")
    parser.add_argument("--problems", type=int, default=64, help="problems to solve")
    parser.add_argument("--group-size", type=int, default=4, help="trajectories per problem (the job's)")
    parser.add_argument("--agents", type=int, default=8, help="agents at once")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="per call; default: what the model's context leaves, at most the endpoint's default")  # fmt: skip
    parser.add_argument("--reward", choices=("answer", "digits"), default="answer")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    problems = get_task(args.task).make_split("train", args.problems, seed=args.seed)
    with concurrent.futures.ThreadPoolExecutor(args.agents) as pool:
        futures = [
            pool.submit(solve, args.url, args.job, args.key, p, f"p{args.seed}-{i}", args)
            for i, p in enumerate(problems)
            for _ in range(args.group_size)
        ]
        rewards = [f.result() for f in futures]
    print(json.dumps({"trajectories": len(rewards), "mean_reward": sum(rewards) / max(len(rewards), 1)}))
    return rewards


if __name__ == "__main__":
    main()
