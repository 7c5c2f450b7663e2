"""`tandem samples JOB [--step N]`: a step's stored trajectories, printed turn by turn as a chat."""

from __future__ import annotations

import argparse
import json
from typing import Any

from api.client import TandemClient


def samples_command(args: argparse.Namespace, client: TandemClient) -> int:
    step = args.step if args.step is not None else client.get_job(args.job_id)["step"]
    rows = client.samples(args.job_id, step=step, limit=args.limit)["data"]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no samples of step {step}")
        return 0
    print("\n\n".join(format_sample(row) for row in rows))
    return 0


def format_sample(row: dict[str, Any]) -> str:
    tokens = row.get("tokens", {})
    head = (
        f"── step {row['step']} · sample {row.get('index', '?')} · reward {row['reward']:.3g} · "
        f"{row.get('finish_reason', '?')} · {tokens.get('trained', '?')}/{tokens.get('response', '?')} "
        "response tokens trained"
    )
    lines = [head, f"[prompt] {row['prompt']}"]
    lines += [f"[{turn['role']}] {turn['content']}" for turn in row.get("turns", [])]
    return "\n".join(lines)


def add_samples_parser(command: Any) -> None:
    p = command(
        "samples", samples_command, "a step's sampled trajectories, as a chat (default: the latest step)"
    )
    p.add_argument("--step", type=int, help="the step (default: the job's latest)")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--json", action="store_true")
