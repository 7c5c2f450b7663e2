"""Two owners on one service, for the owner tests: keys made by the admin, and work of each put in
the store as the service would (the service of these tests runs without Ray: jobs stay queued)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from schema.job import JobSpec
from tests.api_util import LiveService, tiny_job


def make_key(admin: httpx.Client, owner: str, **fields) -> dict:
    made = admin.post("/v1/keys", json={"owner": owner, **fields})
    assert made.status_code == 201, made.text
    return made.json()


@contextmanager
def admin_and_owners(svc: LiveService, *owners: str) -> Iterator[list[httpx.Client]]:
    """[the admin's client, then one client per owner, each with a new key of its own]."""
    with svc.client() as admin:
        clients = [as_key(svc, make_key(admin, owner)["key"]) for owner in owners]
        try:
            yield [admin, *clients]
        finally:
            for client in clients:
                client.close()


@contextmanager
def two_owners(svc: LiveService) -> Iterator[list[httpx.Client]]:
    """[admin, alice, bob]: clients of the admin and of two owners with a key each."""
    with admin_and_owners(svc, "alice", "bob") as clients:
        yield clients


def as_key(svc: LiveService, key: str, header: str = "bearer") -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if header == "bearer" else {"X-API-Key": key}
    return httpx.Client(base_url=svc.url, headers=headers, timeout=30)


def owned_job(svc: LiveService, owner: str, checkpoint: bool = True, **overrides) -> str:
    """A queued job of `owner` with an event, a metric, a log line, a sample and (optionally) a
    complete checkpoint: something on every read route."""
    store = svc.service.store
    spec = JobSpec.model_validate(tiny_job(**overrides)).model_dump(mode="json")
    job = store.create_job(spec, svc.service.jobs_root, owner=owner)
    store.add_metrics(job.id, 1, {"reward/mean": 0.5})
    store.add_logs(job.id, [(1.0, "INFO", f"{owner} was here")])
    store.add_samples(job.id, 1, [{"prompt": f"{owner}'s prompt", "reward": 1.0}])
    if checkpoint:
        folder = Path(job.workdir, "checkpoints", "step_1")
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text(
            json.dumps({"step": 1, "kl_coef": 0.0, "loader": {"epoch": 0, "position": 4}})
        )
        store.add_checkpoint(job.id, 1, str(folder))
    return job.id


def upload(
    client: httpx.Client, name: str = "train.jsonl", body: bytes = b'{"prompt": "1+1", "answer": "2"}\n'
):
    made = client.post("/v1/files", params={"filename": name}, content=body,
                       headers={"content-type": "application/octet-stream"})  # fmt: skip
    assert made.status_code == 201, made.text
    return made.json()
