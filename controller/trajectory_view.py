"""What a step's trajectories look like from outside: multi-turn metrics and stored samples."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from engines.training.base import SCORED
from workers.batch import Batch

log = logging.getLogger("tandem.job")


def multiturn_metrics(batch: Batch) -> dict[str, float]:
    t, nt = batch.tensors, batch.non_tensors
    turns = t["num_turns"].float()
    finish = np.asarray(nt["finish_reason"], dtype=object)
    sampled = t["response_mask"].sum(1).float()
    count = max(len(batch), 1)
    scored = t.get(SCORED, torch.ones(len(batch), dtype=torch.bool))  # False: the environment failed
    rewards = t["env_rewards"].float()[scored]
    return {
        "multiturn/num_turns/mean": float(turns.mean()),
        "multiturn/num_turns/max": float(turns.max()),
        "multiturn/tool_calls/mean": float(t["tool_calls"].float().mean()),
        "multiturn/env_errors": float((finish == "env_error").sum()),
        "multiturn/env_timeouts": float((finish == "env_timeout").sum()),
        "multiturn/truncated_ratio": float(np.isin(finish, ["max_turns", "budget"]).sum()) / count,
        "multiturn/response_tokens_per_turn": float((sampled / turns.clamp(min=1)).mean()),
        **({"multiturn/reward/mean": float(rewards.mean())} if len(rewards) else {}),
    }


MAX_LOGGED_ERRORS = 5  # a step's environment errors written to the job's log; the metrics count all


def log_env_errors(batch: Batch, environment: str | None) -> None:
    errors = [(i, e) for i, e in enumerate(batch.non_tensors.get("env_error", [])) if e]
    if errors:
        shown = "; ".join(f"trajectory {i}: {e}" for i, e in errors[:MAX_LOGGED_ERRORS])
        log.warning("environment %s failed in %d of %d trajectories (not scored): %s", environment,
                    len(errors), len(batch), shown)  # fmt: skip


MAX_TEXT = 2000  # characters kept of any one text field of a stored sample


def step_samples(batch: Batch, scores: Any, tokenizer: Any, count: int) -> list[dict[str, Any]]:
    """The first `count` trajectories of a step, readable: prompt, turns, reward (None where it was not
    scored: its reward failed), tokens trained on (a single-turn row: the prompt and one assistant turn)."""
    t, nt = batch.tensors, batch.non_tensors
    scored = t.get(SCORED, None)
    width = t["response_mask"].shape[1]
    out = []
    for i in range(min(count, len(batch))):
        real = t["attention_mask"][i, -width:].bool()
        response = t["responses"][i][real].tolist()
        trained = t["response_mask"][i][real].tolist()
        if "messages" in nt:
            prompt, turns = split_turns(list(nt["messages"][i]))
        else:  # single-turn
            text = tokenizer.decode(response, skip_special_tokens=True)
            prompt, turns = str(nt["prompt"][i]), [{"role": "assistant", "content": text}]
        out.append(
            {
                "index": i,
                "uid": str(nt["uid"][i]) if "uid" in nt else str(i),
                "prompt": _cut(prompt),
                "turns": [{"role": m["role"], "content": _cut(m["content"])} for m in turns],
                "reward": float(scores[i]) if scored is None or bool(scored[i]) else None,
                "finish_reason": _finish_reason(nt, i, response, trained, width, tokenizer),
                "tokens": {
                    "prompt": int(t["attention_mask"][i].sum()) - len(response),
                    "response": len(response),
                    "trained": int(sum(trained)),
                },
                "spans": _spans(response, trained, tokenizer),
            }
        )
        error = next((str(nt[k][i]) for k in ("reward_error", "env_error") if k in nt and nt[k][i]), None)
        if error:
            out[-1]["error"] = _cut(error)
        if "trajectory_id" in nt:  # an agent's (rollout.source external): its calls are the turns
            out[-1]["trajectory"] = {
                "id": str(nt["trajectory_id"][i]),
                "segment": str(nt["segment_reason"][i]),
            }
    return out


def split_turns(messages: list[dict[str, str]]) -> tuple[str, list[dict[str, str]]]:
    """(the messages before the first assistant turn as text, the turns from it on)."""
    first = next((k for k, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages[:first]), messages[first:]


def _finish_reason(nt: dict, i: int, response: list[int], trained: list[int], width: int, tok: Any) -> str:
    if "finish_reason" in nt:
        return str(nt["finish_reason"][i])
    ends = {tok.eos_token_id, *getattr(tok, "all_special_ids", [])}
    return "stop" if response and response[-1] in ends else "length" if len(response) >= width else "stop"


def _spans(response: list[int], trained: list[int], tokenizer: Any) -> list[dict[str, Any]]:
    """Runs of trained (sampled) and untrained (observation / template) tokens, as text."""
    spans: list[dict[str, Any]] = []
    start = 0
    for k in range(1, len(response) + 1):
        if k == len(response) or trained[k] != trained[start]:
            text = tokenizer.decode(response[start:k], skip_special_tokens=False)
            spans.append({"trained": bool(trained[start]), "tokens": k - start, "text": _cut(text)})
            start = k
    return spans


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "…"
