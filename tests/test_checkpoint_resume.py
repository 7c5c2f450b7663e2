"""Resuming as an unlucky machine or a hostile owner meets it (controller/checkpoints.py): a real tiny job
on a real Ray writes three checkpoints; each test edits a copy of its folder.

A `trainer_state.json` that did not reach the disk whole (a machine that died mid-write) makes its folder
incomplete: the job resumes from the one before. A `checkpoint.resume_from` whose state was edited (a NaN
KL coefficient, a step that is not a count) is refused naming the file and the field.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from controller import checkpoints
from controller.sink import JsonlSink
from controller.trainer import Trainer
from schema.job import JobSpec
from tests.api_util import tiny_job


def spec(**overrides) -> JobSpec:
    return JobSpec.model_validate(tiny_job(resources={"workers": 1, "cpus_per_worker": 1}, **overrides))


@pytest.fixture(scope="module")
def ran(ray_cluster, tmp_path_factory) -> Path:
    """The workdir of a 3-step job checkpointed every step."""
    workdir = tmp_path_factory.mktemp("ran")
    Trainer(spec(), workdir, JsonlSink(workdir), name="ckpt-resume").run()
    assert [s for s, _ in checkpoints.complete(workdir)] == [1, 2, 3]
    return workdir


@pytest.fixture
def workdir(ran, tmp_path) -> Path:
    return Path(shutil.copytree(ran, tmp_path / "job"))


def test_a_state_file_cut_short_by_a_crash_is_passed_over_and_the_job_resumes_before_it(workdir):
    (checkpoints.root(workdir) / "step_00000003" / checkpoints.STATE_FILE).write_text('{"step": 3, "lo')
    sink = JsonlSink(workdir)
    Trainer(spec(trainer={"total_steps": 4}), workdir, sink, name="ckpt-resume-crashed").run()
    resumed = [e for e in sink.events if e["kind"] == "resumed"]
    assert resumed and resumed[0]["message"] == "resumed from step 2"
    assert [s for s, _ in checkpoints.complete(workdir)][-1] == 4


@pytest.mark.parametrize(
    ("edit", "field"),
    [({"kl_coef": float("nan")}, "kl_coef"), ({"step": "3"}, "step"), ({"step": -4}, "step"),
     ({"loader": {"epoch": "x"}}, "loader.epoch")],
)  # fmt: skip
def test_an_edited_resume_from_state_is_refused_naming_the_file_and_field(workdir, tmp_path, edit, field):
    source = checkpoints.root(workdir) / "step_00000002"
    state = json.loads((source / checkpoints.STATE_FILE).read_text())
    (source / checkpoints.STATE_FILE).write_text(json.dumps({**state, **edit}))
    fork = spec(checkpoint={"resume_from": str(source)})
    with pytest.raises(ValueError, match=rf"{checkpoints.STATE_FILE}.*{field}"):
        checkpoints.find_resume_folder(fork, tmp_path / "fork")


def test_a_job_resumed_at_its_last_step_keeps_that_checkpoint_rather_than_rewrite_it(workdir):
    """A final save of a step already committed deleted it before writing it again: a job requeued after
    its last checkpoint (a lost worker in the export) had, for the while, none to resume from."""
    last = checkpoints.root(workdir) / "step_00000003"
    written = {str(p): p.stat().st_mtime_ns for p in last.rglob("*") if p.is_file()}
    sink = JsonlSink(workdir)
    Trainer(spec(checkpoint={"every": 0, "keep_last": 1}), workdir, sink, name="ckpt-resume-last").run()
    assert [e["message"] for e in sink.events if e["kind"] == "resumed"] == ["resumed from step 3"]
    assert {str(p): p.stat().st_mtime_ns for p in last.rglob("*") if p.is_file()} == written
    assert [s for s, _ in checkpoints.complete(workdir)] == [3]
