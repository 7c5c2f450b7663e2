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
    """A trajectory's head line and turns; a Tinker sampler's sample (no reward, nothing trained) names
    its sampler and its response tokens instead."""
    tokens = row.get("tokens", {})
    parts = [f"── step {row['step']} · sample {row.get('index', '?')}"]
    reward = row.get("reward")
    if isinstance(reward, int | float):
        parts.append(f"reward {reward:.3g}")
    if row.get("sampler"):
        parts.append(f"sampler {row['sampler']}")
    parts.append(row.get("finish_reason") or "?")
    trained = tokens.get("trained")
    parts.append(f"{trained}/{tokens.get('response', '?')} response tokens trained" if trained is not None
                 else f"{tokens.get('response', '?')} response tokens")  # fmt: skip
    head = " · ".join(parts)
    lines = [head, f"[prompt] {row.get('prompt', '')}"]
    lines += [f"[{turn['role']}] {turn['content']}" for turn in row.get("turns", [])]
    if row.get("error"):
        lines.append(f"[error] {row['error']}")
    return "\n".join(lines)


def add_samples_parser(command: Any) -> None:
    p = command(
        "samples", samples_command, "a step's sampled trajectories, as a chat (default: the latest step)"
    )
    p.add_argument("--step", type=int, help="the step (default: the job's latest)")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--json", action="store_true")
