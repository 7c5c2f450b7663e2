"""A supervised loop and an RL loop written only against the official `tinker` SDK, as a researcher
writes them (docs/tinker.md shows the same loops): nothing here imports Tandem."""

from __future__ import annotations

import tinker
from tinker import types


def sft_datum(tokenizer, prompt: str, completion: str) -> types.Datum:
    """Next-token prediction on the completion only: position i predicts token i + 1."""
    p = tokenizer.encode(prompt, add_special_tokens=False)
    c = tokenizer.encode(completion, add_special_tokens=False) + [tokenizer.eos_token_id]
    tokens = p + c
    weights = [0.0] * (len(p) - 1) + [1.0] * len(c)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def supervised_loop(tc: tinker.TrainingClient, data: list[types.Datum], steps: int, lr: float) -> list[float]:
    """Per-token mean loss of every step (loss:sum over the summed weights)."""
    tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)
    losses = []
    for _ in range(steps):
        fwd = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fwd.result().metrics["loss:sum"] / tokens)
        opt.result()
    return losses


def rl_loop(tc: tinker.TrainingClient, tokenizer, prompts: list[str], reward, iterations: int, group: int,
            max_tokens: int, lr: float, seed: int | None = None) -> list[float]:  # fmt: skip
    """Sample a group per prompt, score, centre the rewards per group (GRPO-like advantages), train
    with importance_sampling on the sampled tokens; returns the mean reward of every iteration."""
    means = []
    for it in range(iterations):
        sampler = tc.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=None if seed is None else seed + it
        )
        futures = [
            (
                p,
                sampler.sample(
                    types.ModelInput.from_ints(tokenizer.encode(p, add_special_tokens=False)), group, params
                ),
            )
            for p in prompts
        ]
        data, rewards = [], []
        for prompt, future in futures:
            prompt_tokens = tokenizer.encode(prompt, add_special_tokens=False)
            seqs = future.result().sequences
            scores = [reward(prompt, tokenizer.decode(s.tokens)) for s in seqs]
            rewards += scores
            mean = sum(scores) / len(scores)
            for seq, score in zip(seqs, scores, strict=True):
                if not seq.tokens:
                    continue
                tokens = prompt_tokens + list(seq.tokens)
                n_prompt = len(prompt_tokens) - 1
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [0.0] * n_prompt + list(seq.logprobs),
                        "advantages": [0.0] * n_prompt + [score - mean] * len(seq.tokens),
                    },
                ))  # fmt: skip
        means.append(sum(rewards) / len(rewards))
        tc.forward_backward(data, "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=lr)).result()
    return means


def owner_keys(svc, owners=("alice", "bob")) -> dict[str, str]:
    """A `tml-` key of each owner, issued by the service's admin."""
    from tests.owners_util import make_key

    with svc.client() as admin:
        return {owner: make_key(admin, owner)["key"] for owner in owners}


_clients: list[tinker.ServiceClient] = []


def service_client() -> tinker.ServiceClient:
    """An SDK client that `close_clients` ends: left open, its heartbeat thread outlives the module's
    server and logs "Session heartbeat failed" until the test run ends."""
    client = tinker.ServiceClient()
    _clients.append(client)
    return client


def close_clients() -> None:
    """Finish every session `service_client` opened (before the server they talk to stops)."""
    while _clients:
        client = _clients.pop()
        try:
            client.close("success").result(timeout=30)
        except Exception:  # a session a test already ended, or refused: its heartbeat stops regardless
            pass


def served(tmp_path_factory, name: str, bases: list[str], schedule: bool = True):
    """A module's service for the Tinker tests (a fixture's generator): its SDK sessions end before it stops."""
    from api.settings import ServeSettings
    from tests.api_util import start_service

    settings = ServeSettings(tinker_base_models=bases)
    live = start_service(tmp_path_factory.mktemp(name), schedule=schedule, settings=settings)
    yield live
    close_clients()
    live.stop()


def point_sdk(monkeypatch, url: str, key: str) -> None:
    """The environment the official SDK reads: this service and this key, no credential command."""
    monkeypatch.setenv("TINKER_BASE_URL", url)
    monkeypatch.setenv("TINKER_API_KEY", key)
    monkeypatch.delenv("TINKER_CREDENTIAL_CMD", raising=False)
