"""Paths are owned: every server path a spec names must be its submitter's upload, an output of one of
their jobs, or in a folder the operator shares; never the service's own files; and tracker
destinations must be ones the operator allows (service/owned_paths.py, service/tracker_policy.py).

Two owners on one service whose jobs stay queued (no training runs): most checks go through
`POST /v1/jobs/validate`; the check again at a job's start is driven through the scheduler's launch.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from api.settings import EXAMPLES_DIR, ServeSettings
from schema.job import JobSpec
from service.tracker_policy import TrackerPolicy, TrackerRefused, host_entry
from tests.api_util import LiveService, start_service, tiny_job
from tests.owners_util import owned_job, two_owners, upload

MLFLOW_HOST = "mlflow.example.internal:5000"


def module_py(marker: Path) -> bytes:
    """A reward, an environment and an agent in one file; importing it outside a sandbox (which may
    write nothing of the host's) leaves `marker` behind."""
    return (f"try:\n    open({str(marker)!r}, 'w').write('imported')\nexcept OSError:\n    pass\n"
            "def score(prompt, response, ground_truth, extra):\n    return 1.0\n"
            "class Env:\n    pass\n"
            "def agent(client, model, index):\n    return 1.0\n").encode()  # fmt: skip


@pytest.fixture(scope="module")
def svc(ray_cluster, tmp_path_factory) -> LiveService:
    shared = tmp_path_factory.mktemp("shared")
    settings = ServeSettings(allowed_paths=[shared, EXAMPLES_DIR], tracker_hosts=[MLFLOW_HOST])
    live = start_service(tmp_path_factory.mktemp("owned-home"), settings=settings, schedule=False)
    live.shared = shared  # type: ignore[attr-defined]
    yield live
    live.stop()


@pytest.fixture(scope="module")
def owners(svc):
    with two_owners(svc) as clients:
        yield clients


@pytest.fixture(scope="module")
def world(svc, owners, tmp_path_factory) -> dict:
    """Alice's and bob's uploads and job outputs, and a shared folder with honest and hostile entries."""
    admin, alice, bob = owners
    home, shared = Path(svc.service.home).resolve(), svc.shared
    markers = tmp_path_factory.mktemp("markers")
    files = svc.service.files
    w = {"home": home, "shared": shared, "marker": markers / "alice"}
    for who, client in (("alice", alice), ("bob", bob)):
        w[f"{who}_data"] = str(files.path(upload(client, f"{who}_train.jsonl")["id"]))
        w[f"{who}_py"] = str(files.path(upload(client, f"{who}_mod.py", module_py(markers / who))["id"]))
        job = owned_job(svc, who)
        workdir = svc.service.store.get_job(job).workdir
        (Path(workdir) / "export").mkdir()
        (Path(workdir) / "export" / "config.json").write_text("{}")
        w[f"{who}_job"], w[f"{who}_export"] = job, f"{workdir}/export"
        w[f"{who}_checkpoint"] = f"{workdir}/checkpoints/step_1"
    assert not w["marker"].exists()  # nothing imported alice's module; a check that did would leave it
    (shared / "data.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    (shared / "model").mkdir()
    (shared / "model" / "config.json").write_text("{}")
    (shared / "to_db").symlink_to(home / "tandem.db")
    (shared / "to_alice.jsonl").symlink_to(w["alice_data"])
    (shared / "poisoned").mkdir()  # a model folder whose weights are alice's upload
    (shared / "poisoned" / "config.json").write_text("{}")
    (shared / "poisoned" / "model.safetensors").symlink_to(w["alice_data"])
    (shared / "loop").symlink_to(shared / "loop")
    return w


def refused(response: httpx.Response, param: str, code: str = "path_not_allowed") -> str:
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    return error["message"]


def validate(client: httpx.Client, **spec) -> httpx.Response:
    return client.post("/v1/jobs/validate", json=tiny_job(**spec))


def spec_of(**spec) -> dict:
    return JobSpec.model_validate(tiny_job(**spec)).model_dump(mode="json")


def data(path: str) -> dict:
    return {"data": {"train_path": path, "builtin_task": None}}


def test_another_owners_upload_by_path_is_refused_as_a_missing_one_is(owners, world):
    admin, alice, bob = owners
    theirs = refused(validate(bob, **data(world["alice_data"])), "data.train_path")
    missing = world["home"] / "files" / "file-000000000000" / "alice_train.jsonl"
    assert theirs.replace(world["alice_data"], "P") == refused(
        validate(bob, **data(str(missing))), "data.train_path"
    ).replace(str(missing), "P")  # the message does not tell "not yours" from "not there"
    sneaky = f"{Path(world['bob_data']).parent}/../{Path(world['alice_data']).parent.name}/alice_train.jsonl"
    refused(validate(bob, **data(sneaky)), "data.train_path")
    refused(validate(bob, data={"train_path": world["bob_data"], "val_path": world["alice_data"],
                                "builtin_task": None}), "data.val_path")  # fmt: skip
    assert validate(bob, **data(world["bob_data"])).status_code == 200  # one's own, by path
    assert validate(admin, **data(world["alice_data"])).status_code == 200  # the admin sees every upload


def test_another_owners_code_by_path_is_refused_and_never_imported(owners, world):
    admin, alice, bob = owners
    py = world["alice_py"]
    refused(validate(bob, reward={"function": f"{py}:score"}), "reward.function")
    refused(validate(bob, rollout={"environment": f"{py}:Env"}), "rollout.environment")
    external = {
        "source": "external",
        "external": {"group_size": 2, "trajectories_per_step": 4, "agent": f"{py}:agent"},
    }
    refused(validate(bob, rollout=external), "rollout.external.agent")
    tried = bob.post("/v1/rewards/validate", json={"function": f"{py}:score", "rows": [{"response": "2"}]})
    refused(tried, "function")
    assert not world["marker"].exists()  # no check imported alice's module for bob
    mine = bob.post(
        "/v1/rewards/validate", json={"function": f"{world['bob_py']}:score", "rows": [{"response": "2"}]}
    )
    assert mine.status_code == 200 and mine.json()["scores"] == [1.0], mine.text


@pytest.mark.parametrize(
    "spec,param",
    [
        (lambda p: {"model": {"builtin": None, "path": p}}, "model.path"),
        (
            lambda p: {"method": "ppo", "model": {"builtin": "tiny-qwen2", "critic_path": p}},
            "model.critic_path",
        ),
        (lambda p: {"reward": {"function": None, "model_path": p}}, "reward.model_path"),
        (
            lambda p: {"model": {"builtin": "tiny-qwen2", "lora": {"rank": 4, "init_from": p}}},
            "model.lora.init_from",
        ),
    ],
)
def test_another_owners_job_outputs_are_refused_and_ones_own_pass(owners, world, spec, param):
    admin, alice, bob = owners
    refused(validate(bob, **spec(world["alice_export"])), param)
    if param != "model.lora.init_from":  # (an export with no adapter in it is no adapter)
        assert validate(bob, **spec(world["bob_export"])).status_code == 200
        assert validate(admin, **spec(world["alice_export"])).status_code == 200


def test_another_owners_checkpoint_is_refused_and_ones_own_resumes(owners, world):
    admin, alice, bob = owners
    refused(validate(bob, checkpoint={"resume_from": world["alice_checkpoint"]}), "checkpoint.resume_from")
    assert validate(bob, checkpoint={"resume_from": world["bob_checkpoint"]}).status_code == 200


@pytest.mark.parametrize(
    ("state", "field"), [('{"step": 1, "kl_coef": NaN, "loader": {}}', "kl_coef"), ("", "Expecting value"),
                         ('{"step": "1", "kl_coef": 0, "loader": {}}', "step"), (None, "not a regular file"),
                         ("fifo", "not a regular file")],
)  # fmt: skip
def test_ones_own_checkpoint_with_a_state_no_resume_can_read_is_refused_naming_it(
    owners, world, state, field
):
    """Edited, cut short or missing: a 422 at submission, not a job that fails when it starts."""
    admin, alice, bob = owners
    folder = Path(world["bob_checkpoint"]).with_name("step_2")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    if state == "fifo":  # a read would wait for a writer forever
        os.mkfifo(folder / "trainer_state.json")
    elif state is not None:
        (folder / "trainer_state.json").write_text(state)
    message = refused(
        validate(bob, checkpoint={"resume_from": str(folder)}), "checkpoint.resume_from", "invalid_value"
    )
    assert "trainer_state.json" in message and field in message


def test_a_fork_of_ones_own_job_works_and_its_copy_is_its_owners(svc, owners, world):
    admin, alice, bob = owners
    child = bob.post(f"/v1/jobs/{world['bob_job']}/fork", json={"overrides": {"trainer": {"total_steps": 5}}})
    assert child.status_code == 201, child.text
    copy = child.json()["spec"]["checkpoint"]["resume_from"]
    assert "/jobs/fork-sources/" in copy and Path(copy, "trainer_state.json").exists()
    assert validate(bob, checkpoint={"resume_from": copy}).status_code == 200  # as a fork of a fork does
    refused(validate(alice, checkpoint={"resume_from": copy}), "checkpoint.resume_from")
    grandchild = bob.post(f"/v1/jobs/{child.json()['id']}/fork")
    assert grandchild.status_code == 409, grandchild.text  # checked, then: the child has no checkpoint yet
    assert bob.post(f"/v1/jobs/{world['alice_job']}/fork").status_code == 404


@pytest.mark.parametrize("name", ["tandem.db", "tandem.db-wal", "service.json", "admin_token", "files", "jobs",
                                  "jobs/fork-sources", "models/tiny-qwen2", "no-such-file"])  # fmt: skip
def test_the_services_own_files_are_refused_to_every_owner_and_the_admin(owners, world, name):
    admin, alice, bob = owners
    path = str(world["home"] / name)
    nothing = str(world["home"] / "no-such-file")
    for client in (admin, bob):
        message = refused(validate(client, **data(path)), "data.train_path")
        assert message.replace(path, "P") == refused(
            validate(client, **data(nothing)), "data.train_path"
        ).replace(nothing, "P")
        refused(validate(client, model={"builtin": None, "path": path}), "model.path")


def test_symlinks_dotdot_and_relative_paths_cannot_leave_the_shared_folder(owners, world):
    admin, alice, bob = owners
    shared = world["shared"]
    for path in (
        shared / "to_db",
        shared / "to_alice.jsonl",
        f"{shared}/../{world['home'].name}/tandem.db",
        "/etc/passwd",
    ):
        refused(validate(bob, **data(str(path))), "data.train_path")
    refused(validate(bob, model={"builtin": None, "path": str(shared / "poisoned")}), "model.path")
    refused(validate(bob, **data(str(shared / "loop"))), "data.train_path", "invalid_value")
    for path in ("data.jsonl", "~/x.jsonl", "/tmp/a\u0000b.jsonl", f"{world['bob_export']}/{'x' * 300}"):
        refused(validate(bob, **data(path)), "data.train_path", "invalid_value")
    long_name = f"{world['bob_export']}/{'x' * 300}/../config.json"  # resolves short; the name is too long
    refused(validate(bob, **data(long_name)), "data.train_path", "not_found")
    builtin_trick = f"builtin:/../../../../../../../../..{world['alice_py']}:score"  # the loaders' last ':'
    refused(validate(bob, reward={"function": builtin_trick}), "reward.function", "invalid_reward_function")
    assert not world["marker"].exists()


def test_shared_folders_and_the_examples_are_readable_by_every_owner(owners, world):
    admin, alice, bob = owners
    for client in (alice, bob):
        assert validate(client, **data(str(world["shared"] / "data.jsonl"))).status_code == 200
        assert (
            validate(client, model={"builtin": None, "path": str(world["shared"] / "model")}).status_code
            == 200
        )
        reward = {"function": f"{EXAMPLES_DIR}/my_reward.py:score"}
        assert validate(client, reward=reward).status_code == 200


def test_a_job_whose_paths_are_not_its_owners_fails_when_it_starts(svc, world):
    """A row that names alice's upload for bob (as one submitted before the check existed would)."""
    store, scheduler = svc.service.store, svc.service.scheduler
    theirs = store.create_job(spec_of(**data(world["alice_data"])), svc.service.jobs_root, owner="bob")
    scheduler._launch(theirs, 1.0, 0.0)
    failed = store.get_job(theirs.id)
    assert failed.status == "failed" and failed.error.startswith("data.train_path: "), failed.error
    link = str(world["home"] / "jobs" / world["bob_job"] / "export" / ".." / "export")
    mine = store.create_job(
        spec_of(model={"builtin": None, "path": link}), svc.service.jobs_root, owner="bob"
    )
    spec = scheduler.spec_to_run(store.get_job(mine.id), own_checkpoint=False)
    assert spec.model.path == str(Path(world["bob_export"]).resolve())  # what was checked is what runs


def test_mlflow_servers_and_schemes_are_the_operators_to_allow(owners, world):
    admin, alice, bob = owners

    def mlflow(uri: str) -> httpx.Response:
        return validate(bob, trainer={"loggers": ["mlflow"], "mlflow_uri": uri})

    assert mlflow(f"http://{MLFLOW_HOST}").status_code == 200
    assert mlflow(f"https://{MLFLOW_HOST.upper()}/api").status_code == 200
    for uri in ("http://mlflow.example.internal:5001", "http://127.0.0.1:5000", "http://localhost:8265",
                f"http://{MLFLOW_HOST}@evil.example", f"http://u:p@{MLFLOW_HOST}", "http://[::1]:5000",
                "http://mlflow.example.internal:99999", "sqlite:////tmp/mlflow.db", "databricks://profile",
                "postgresql://db/mlflow", "http://mlflow.example.internal\\@x:5000", "http://[mlflow"):  # fmt: skip
        message = refused(mlflow(uri), "trainer.mlflow_uri", "tracker_not_allowed")
        assert "p@" not in message or "credentials" in message
    assert "--allow-tracker-host mlflow.example.internal:5001" in refused(
        mlflow("http://mlflow.example.internal:5001"), "trainer.mlflow_uri", "tracker_not_allowed"
    )
    own = f"{world['home']}/jobs/{world['bob_job']}/mlruns"
    assert mlflow(own).status_code == 200 and mlflow(f"file://{own}").status_code == 200
    theirs = f"{world['home']}/jobs/{world['alice_job']}/mlruns"
    for uri in (theirs, f"file://{theirs}", f"file://{world['home']}/tandem.db", f"file:{world['shared']}/runs",
                f"file://{world['home']}/jobs/{world['bob_job']}/%2e%2e/{world['alice_job']}"):  # fmt: skip
        refused(mlflow(uri), "trainer.mlflow_uri")
    refused(mlflow("databricks"), "trainer.mlflow_uri", "invalid_value")  # not an absolute folder either


def test_wandb_needs_the_operators_leave(owners):
    admin, alice, bob = owners
    for client in (admin, bob):
        message = refused(
            validate(client, trainer={"loggers": ["wandb"]}), "trainer.loggers", "tracker_not_allowed"
        )
        assert "--allow-wandb" in message
    assert validate(bob, trainer={"loggers": ["tensorboard", "mlflow"]}).status_code == 200


def test_tracker_allow_lists_and_serve_flags(tmp_path):
    from api.cli import build_parser

    assert host_entry(" MLflow.Internal:5000 ") == "mlflow.internal:5000" and host_entry("h") == "h"
    for bad in ("h:0", "h:x", "http://h", "a b", "", "h:70000"):
        with pytest.raises(ValueError):
            host_entry(bad)
    with pytest.raises(ValueError):
        ServeSettings(tracker_hosts=["http://h"])
    policy = TrackerPolicy.of(["h"], wandb=True)
    policy.check_loggers(["wandb"])
    assert policy.mlflow_folder("http://h:1234") is None  # a bare host allows every port
    with pytest.raises(TrackerRefused):
        TrackerPolicy().check_loggers(["wandb"])
    args = build_parser().parse_args(["serve", "--allow-wandb", "--allow-tracker-host", "h:1",
                                      "--allow-path", str(tmp_path)])  # fmt: skip
    assert (args.allow_wandb, args.allow_tracker_host, args.allow_path) == (True, ["h:1"], [str(tmp_path)])
    assert ServeSettings().shared_roots() == [EXAMPLES_DIR.resolve()]
    bad = subprocess.run([sys.executable, "-m", "api.cli", "serve", "--allow-tracker-host", "http://h",
                          "--home", str(tmp_path / "home")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and "tandem serve: tracker_hosts: tracker host 'http://h'" in bad.stderr, (
        bad.stderr
    )
    assert not (tmp_path / "home").exists()  # refused before anything started
