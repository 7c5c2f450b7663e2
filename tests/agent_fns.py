"""Agents the tests' jobs run themselves (rollout.external.agent 'tests.agent_fns:NAME'): light to
import, as the service checks a reference in a child process."""

from __future__ import annotations


def digits_agent(client, model: str, index: int) -> dict:
    """One call; the share of digits in the answer, grouped by task index."""
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"{index}+1="}], max_tokens=4
    )
    text = reply.choices[0].message.content or ""
    return {"reward": sum(ch.isdigit() for ch in text) / max(len(text), 1), "task_id": f"t{index}"}


not_a_function = 42


def unruly_agent(client, model: str, index: int) -> dict:
    """digits_agent, but task 0 answers a NaN reward and task 1 a list for its task id: the endpoint
    refuses both as the API would."""
    out = digits_agent(client, model, index)
    if index == 0:
        out["reward"] = float("nan")
    elif index == 1:
        out["task_id"] = [out["task_id"]]
    return out


def exits_on_task_zero(client, model: str, index: int) -> float:
    """Ends its own process on task 0 (as a memory limit would), answers 1.0 on the others."""
    if index == 0:
        import os

        os._exit(3)
    return 1.0


def paced_agent(client, model: str, index: int) -> float:
    """Makes no call: a reward after a short wait (the endpoint refuses it: no trajectory recorded)."""
    import time

    time.sleep(0.2)
    return 1.0
