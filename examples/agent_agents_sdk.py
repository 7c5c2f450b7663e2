"""An agent written with the OpenAI Agents SDK (`openai-agents`) that a Tandem job trains on.

The agent is the SDK's own: `Agent(model=<job id>)` uses its default model, `OpenAIResponsesModel`,
which calls the job's `POST .../v1/responses` through the client set with
`set_default_openai_client`; a `@function_tool` evaluates arithmetic. With `--output-type answer`
the agent's `output_type` is a small pydantic model: the SDK asks for JSON matching its schema
(`text.format` json_schema), the job's engines hold the reply to it by constrained decoding, and the
SDK parses it. `--tool-choice` forces ("required") or withholds ("none") the tool. Nothing in it knows Tandem
except the endpoint's base URL, the `X-Tandem-Trajectory` header that names each run's trajectory
(every model call of the run is recorded in it, token-exact), and the reward posted at the end.
Run it against a job submitted with examples/agent_openai.yaml:

    tandem submit examples/agent_openai.yaml          # prints the job id
    python examples/agent_agents_sdk.py --url http://127.0.0.1:8000 --job JOB_ID --key "$(cat ~/.tandem/admin_token)"

A run the SDK ends with an error (the reply cut at max tokens, too many turns) scores 0: its calls
are recorded all the same, so the job learns from it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import uuid

import httpx
from agents import (
    Agent,
    AgentsException,
    ModelSettings,
    RunConfig,
    Runner,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

from controller.tasks import get_task
from workers.environments.calculator import CalculatorError, evaluate


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as 347*218."""
    try:
        return str(evaluate(expression))
    except CalculatorError as err:
        return f"error: {err}"


class Answer(BaseModel):
    """The agent's final output with `--output-type answer`: JSON the SDK parses into this."""

    value: int = Field(ge=-(10**9), le=10**9, description="the result of the arithmetic")


def score(answer: str, truth: str, reward: str) -> float:
    if reward == "digits":
        return sum(ch.isdigit() for ch in answer) / max(len(answer), 1)
    found = re.search(r"-?\d+", answer)
    return float(found is not None and found.group(0) == truth)


async def solve(agent: Agent, problem: dict, group: str, args: argparse.Namespace) -> tuple[str, float, str]:
    """One trajectory: the agent's run (its model calls all in the trajectory), then its reward.
    (trajectory id, reward, the final output as text: "" when the run ended in an error)."""
    trajectory = f"{group}-{uuid.uuid4().hex[:8]}"
    settings = ModelSettings(max_tokens=args.max_tokens, tool_choice=args.tool_choice,
                             extra_headers={"X-Tandem-Trajectory": trajectory})  # fmt: skip
    try:
        result = await Runner.run(agent, problem["prompt"], max_turns=args.max_turns,
                                  run_config=RunConfig(model_settings=settings))  # fmt: skip
        output = result.final_output
        answer = str(output.value if isinstance(output, Answer) else output)
    except AgentsException:
        answer = ""
    reward = score(answer, problem["ground_truth"], args.reward) if answer else 0.0
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {args.key}"}, timeout=60) as http:
        posted = await http.post(f"{args.url}/v1/jobs/{args.job}/trajectories/{trajectory}/reward",
                                 json={"reward": reward, "task_id": group})  # fmt: skip
    posted.raise_for_status()
    return trajectory, reward, answer


async def run(args: argparse.Namespace) -> list[tuple[str, float, str]]:
    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    client = AsyncOpenAI(base_url=f"{args.url}/v1/jobs/{args.job}/openai/v1", api_key=args.key)
    set_default_openai_client(client, use_for_tracing=False)
    agent = Agent(name="calculator", instructions="Solve the arithmetic problem; use the calculator.",
                  model=args.job, tools=[calculator],
                  output_type=Answer if args.output_type == "answer" else None)  # fmt: skip
    problems = get_task(args.task).make_split("train", args.problems, seed=args.seed)
    gate = asyncio.Semaphore(args.agents)

    async def one(problem: dict, group: str) -> tuple[str, float, str]:
        async with gate:
            return await solve(agent, problem, group, args)

    runs = [one(p, f"sdk{args.seed}-{i}") for i, p in enumerate(problems) for _ in range(args.group_size)]
    return list(await asyncio.gather(*runs))


def main(argv: list[str] | None = None) -> list[tuple[str, float, str]]:
    """(trajectory id, reward, final output) of every run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the Tandem service, e.g. http://127.0.0.1:8000")
    parser.add_argument("--job", required=True)
    parser.add_argument("--key", required=True, help="a Tandem API key")
    parser.add_argument("--task", default="calculator", help="a built-in task (controller/tasks)")
    parser.add_argument("--problems", type=int, default=16, help="problems to solve")
    parser.add_argument("--group-size", type=int, default=4, help="runs per problem (the job's group_size)")
    parser.add_argument("--agents", type=int, default=8, help="runs at once")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--reward", choices=("answer", "digits"), default="answer")
    parser.add_argument(
        "--output-type",
        choices=("text", "answer"),
        default="text",
        help="answer: the final output is JSON parsed into `Answer` (structured output)",
    )
    parser.add_argument("--tool-choice", choices=("auto", "required", "none"), default=None)
    parser.add_argument("--seed", type=int, default=0)
    runs = asyncio.run(run(parser.parse_args(argv)))
    print(json.dumps({"runs": len(runs), "mean_reward": sum(r for _, r, _ in runs) / max(len(runs), 1)}))
    return runs


if __name__ == "__main__":
    main()
