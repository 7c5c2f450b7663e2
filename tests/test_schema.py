"""The schema package: torch-free, each backend's limits checked at submission, the spec parsed once
by the store and handed on typed, and field descriptions that say what a field does."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from pydantic import ValidationError

from engines.rollout import ROLLOUT_ENGINES
from schema.job import JobSpec
from tests.api_util import tiny_job

ROOT = Path(__file__).resolve().parents[1]
MODULES = [p.stem for p in (ROOT / "schema").glob("*.py") if p.stem != "__init__"]


def test_the_schema_imports_without_torch_ray_or_transformers() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {MODULES!r}: importlib.import_module('schema.' + name)\n"
        "print(sorted(m for m in ('torch', 'ray', 'transformers', 'numpy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert {"job", "engine", "workers", "losses", "tinker_losses", "async_rl"} <= set(MODULES)


def lora_job(backend: str, rank: int) -> dict:
    return {"model": {"builtin": "qwen2-1m", "lora": {"rank": rank}}, "rollout": {"backend": backend}}


def test_vllm_refuses_a_lora_rank_it_cannot_serve_at_submission_naming_the_field() -> None:
    from engines.rollout.vllm import VLLM_LORA_RANKS

    assert ROLLOUT_ENGINES.entry("vllm").max_lora_rank == VLLM_LORA_RANKS[-1] == 512
    for rank in (513, 1024):
        with pytest.raises(ValidationError) as err:
            JobSpec.model_validate(lora_job("vllm", rank))
        first = err.value.errors()[0]
        assert first["loc"] == ("model", "lora", "rank")
        assert "vllm" in first["msg"] and "up to rank 512" in first["msg"]
    assert JobSpec.model_validate(lora_job("vllm", 512)).model.lora.rank == 512
    for backend in ("hf", "sglang"):  # no such limit: the whole LoraConfig range
        assert JobSpec.model_validate(lora_job(backend, 1024)).model.lora.rank == 1024


def test_the_api_refuses_the_rank_with_a_4xx_naming_model_lora_rank(unscheduled) -> None:
    with unscheduled.client() as client:
        answer = client.post(
            "/v1/jobs", json=tiny_job(model={"lora": {"rank": 600}}, rollout={"backend": "vllm"})
        )
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["param"] == "model.lora.rank" and "up to rank 512" in error["message"]
        assert client.get("/v1/jobs").json()["data"] == []


def test_offloading_the_trainer_is_refused_on_placement_split_naming_the_field(unscheduled) -> None:
    """The trainer of a split job generates nothing, so the setting would free nothing: a 422, not a no-op."""
    split = {"placement": "split", "rollout": {"workers": 1}}
    with pytest.raises(ValidationError) as err:
        JobSpec.model_validate(tiny_job(rollout={"offload_trainer_during_rollout": True}, resources=split))
    first = err.value.errors()[0]
    assert first["loc"] == ("rollout", "offload_trainer_during_rollout") and "split" in first["msg"]
    assert JobSpec.model_validate(tiny_job(rollout={"offload_trainer_during_rollout": True})).rollout
    with unscheduled.client() as client:
        answer = client.post(
            "/v1/jobs", json=tiny_job(rollout={"offload_trainer_during_rollout": True}, resources=split)
        )
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["param"] == "rollout.offload_trainer_during_rollout" and "split" in error["message"]


def test_a_pass_count_is_refused_naming_trainer_epochs(unscheduled) -> None:
    """trainer.epochs was accepted and read by nothing: 3 passes ran as many steps as 1."""
    assert JobSpec.model_validate(tiny_job(trainer={"epochs": 1})).trainer.epochs == 1
    for epochs in (0, 3, -1):
        with pytest.raises(ValidationError) as err:
            JobSpec.model_validate(tiny_job(trainer={"epochs": epochs}))
        first = err.value.errors()[0]
        assert first["loc"] == ("trainer", "epochs") and "trainer.total_steps" in first["msg"]
    with unscheduled.client() as client:
        answer = client.post("/v1/jobs", json=tiny_job(method="sft", trainer={"epochs": 3}))
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["param"] == "trainer.epochs" and "trainer.total_steps" in error["message"]


def test_trainer_call_timeout_s_is_bounded_and_outlasts_the_collectives(unscheduled) -> None:
    """A step's calls end within trainer.call_timeout_s: 1..3600 s, and longer than a collective may wait
    (else a call would end first and name every rank of the collective silent, not the hung one)."""
    assert JobSpec.model_validate(tiny_job()).trainer.call_timeout_s == 3600  # the limit before the field
    short = {"call_timeout_s": 5, "collective_timeout_s": 2}
    assert JobSpec.model_validate(tiny_job(trainer=short)).trainer.call_timeout_s == 5
    # unset, it leaves a collective longer than its default as before (a 422 would ask the impossible)
    assert (
        JobSpec.model_validate(tiny_job(trainer={"collective_timeout_s": 7200})).trainer.call_timeout_s
        == 3600
    )
    for value, words in [(0, "greater than or equal to 1"), (3601, "less than or equal to 3600"),
                         ("soon", "valid number"), (600, "must exceed trainer.collective_timeout_s (600s)")]:  # fmt: skip
        with pytest.raises(ValidationError) as err:
            JobSpec.model_validate(tiny_job(trainer={"call_timeout_s": value}))
        first = err.value.errors()[0]
        assert first["loc"] == ("trainer", "call_timeout_s") and words in first["msg"], first
    with unscheduled.client() as client:
        answer = client.post("/v1/jobs/validate", json=tiny_job(trainer={"call_timeout_s": 60}))
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["param"] == "trainer.call_timeout_s", error
        assert error["message"].startswith("trainer.call_timeout_s (60s) must exceed"), error


@contextmanager
def counted_parses() -> Iterator[list[int]]:
    """Counts JobSpec validations in this thread: its cross-section rule runs once per parse."""
    calls = [0]

    def profile(frame, event, arg):  # noqa: ANN001 -- the sys.setprofile signature
        code = frame.f_code
        if event == "call" and code.co_name == "_consistent" and code.co_filename.endswith("job.py"):
            calls[0] += 1

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)


@pytest.mark.parametrize("given", ["typed", "dict"])
def test_the_store_parses_a_spec_once_and_the_controller_gets_it_typed(
    given, unscheduled, tmp_path, monkeypatch
) -> None:
    """Submitted in this process (typed, as `Service.submit` stores it), the spec is never parsed again;
    stored by another (a dict here, a row written before a restart), it is parsed once."""
    from controller.job_actor import JobController
    from controller.worker_output import ENV

    service = unscheduled.service
    submitted = JobSpec.model_validate(tiny_job(notes=uuid.uuid4().hex))  # a text no one parsed yet
    row = submitted if given == "typed" else submitted.model_dump(mode="json")
    job_id = service.store.create_job(row, service.jobs_root).id
    monkeypatch.setenv(ENV, str(tmp_path / "output"))  # the controller sets it for its workers
    with counted_parses() as parses:
        first, again = service.store.get_job(job_id), service.store.get_job(job_id)
        assert first.job_spec is again.job_spec  # every read of the row shares one JobSpec
        spec = service.scheduler.spec_to_run(again, own_checkpoint=False)
        assert isinstance(spec, JobSpec) and spec == submitted  # nothing to resolve: the same values
        controller = JobController(job_id, spec, str(tmp_path / "job"))
    logging.getLogger().removeHandler(controller.logs)
    assert parses[0] == (0 if given == "typed" else 1), f"{parses[0]} parses of one stored spec"
    assert (first.job_spec is submitted) == (given == "typed")
    assert controller.trainer.spec is spec
    assert first.job_spec.trainer.max_restarts == 3  # the default, read from the parsed spec


def test_a_resolved_spec_keeps_the_parse_and_changes_only_the_resolved_fields(unscheduled) -> None:
    from schema.section import changed_values, with_values

    spec = JobSpec.model_validate(tiny_job(data={"builtin_task": None, "train_path": "file-abc"}))
    before = spec.model_dump()
    after = {**before, "data": {**before["data"], "train_path": "/srv/files/abc.jsonl"}}
    with counted_parses() as parses:
        resolved = with_values(spec, changed_values(before, after))
    assert parses[0] == 0
    assert resolved.data.train_path == "/srv/files/abc.jsonl" and spec.data.train_path == "file-abc"
    assert resolved.model_dump() == after


# A measured figure: a ratio (2.1x), a time (50-500 ms) or a pointer to the results.
FIGURE = re.compile(r"\d(\.\d+)?x\b|\d\s?(ms|s)\b|bench/|RESULTS|measured", re.IGNORECASE)


def test_no_jobspec_field_description_holds_a_measured_figure() -> None:
    found = []

    def walk(node: object, where: str) -> None:
        if isinstance(node, dict):
            text = node.get("description")
            if isinstance(text, str) and FIGURE.search(text):
                found.append(f"{where}: {FIGURE.search(text).group(0)!r}")
            for key, value in node.items():
                walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for value in node:
                walk(value, where)

    walk(JobSpec.model_json_schema(), "JobSpec")
    assert not found, found
