"""Hostile user code against a real service: an owner's uploaded module tries to read the admin
token, the SQLite store and another owner's upload, to find secrets in its environment, to reach the
service's port, and to exhaust CPU, memory and processes; as a reward (validated, and inside a job),
as an environment (validated, and as the workers host it), as an agent (whose out-of-bounds call is
refused as the API refuses it), and at submission. Every read fails, nothing secret comes back in an
error, the service stays up, and the API process never imports the module (it writes a marker with
its pid wherever it is imported and can)."""

from __future__ import annotations

import os
import time

import httpx
import pytest

from api.settings import ServeSettings
from schema.workers import EnvironmentConfig
from tests.api_util import TERMINAL, start_service, tiny_job, wait_for
from tests.owners_util import as_key, make_key, upload
from workers.environments.sandboxed import environment_factory, release
from workers.sandbox.launch import probe

TIMEOUT_S = 20.0
HOSTILE = """
import os, pathlib, socket

TARGETS = {targets!r}
PORT = {port}
try:  # where the API imported this, the marker names its pid; a sandbox cannot reach the folder
    pathlib.Path({marker!r}, f"imported-{{os.getpid()}}").write_text("imported")
except OSError:
    pass


def leaks():
    found = []
    for path in TARGETS:
        try:
            found.append(pathlib.Path(path).read_bytes()[:64])
        except OSError:
            pass
    found += [k for k in os.environ if k.startswith(("TANDEM", "WANDB", "MLFLOW")) or k.endswith(("_TOKEN", "_KEY"))]
    try:
        socket.create_connection(("127.0.0.1", PORT), timeout=3).close()
        found.append("reached the service")
    except OSError:
        pass
    return found


if leaks():  # at import: what a submission check runs
    raise RuntimeError(f"LEAKED at import: {{leaks()!r}}")


def score(prompt, response, ground_truth, extra):
    found = leaks()
    if found:
        raise RuntimeError(f"LEAKED {{found!r}}")
    return 1.0  # every read failed


def echo_token(prompt, response, ground_truth, extra):
    raise RuntimeError("token: " + pathlib.Path(TARGETS[0]).read_text())


def spin(prompt, response, ground_truth, extra):
    while True:
        pass


def allocate(prompt, response, ground_truth, extra):
    return float(len(bytearray(10 * 1024**3)))


def fork_bomb(prompt, response, ground_truth, extra):
    while True:
        os.fork()


class Env:
    def reset(self, row):
        return "clean" if not leaks() else f"LEAKED {{leaks()!r}}"

    def step(self, text):
        return None, 0.0 if leaks() else 1.0, True, {{}}


def agent(client, model, index):
    found = leaks()
    asked = {{"model": model, "messages": [{{"role": "user", "content": "1+1="}}], "max_tokens": 2}}
    client.chat.completions.create(**asked)
    try:  # a body the API would refuse: the endpoint refuses it too, naming the field
        client.chat.completions.create(**asked, temperature=50.0)
        found.append("a temperature of 50 was answered")
    except Exception as err:
        if "422" not in str(err) or "temperature" not in str(err):
            found.append(f"refused without naming the field: {{err}}")
    return {{"reward": 0.0 if found else 1.0, "task_id": f"t{{index}}"}}
"""


@pytest.fixture(scope="module")
def svc(ray_cluster, tmp_path_factory):
    monkey = pytest.MonkeyPatch()
    home = tmp_path_factory.getbasetemp() / "hostile-home"
    monkey.setenv("TANDEM_HOME", str(home))
    monkey.setenv("WANDB_API_KEY", "wandb-secret")  # a service secret in its environment
    settings = ServeSettings(user_code_timeout_s=TIMEOUT_S, user_code_cpu_s=10)
    service = start_service(home, settings=settings)
    yield service
    service.stop()
    monkey.undo()


@pytest.fixture(scope="module")
def world(svc, tmp_path_factory):
    """Alice's secret upload, Mallory's hostile module (uploaded), the API's pid, the marker folder."""
    marker = tmp_path_factory.mktemp("markers")
    with svc.client() as admin:
        alice = as_key(svc, make_key(admin, "alice")["key"])
        mallory = as_key(svc, make_key(admin, "mallory")["key"])
        api_pid = admin.get("/v1/service").json()["pid"]
    home = svc.service.home
    secret = upload(alice, "alice_secret.py", b"SECRET = 'alice-only'\n")
    targets = [
        str(home / "admin_token"),
        str(home / "tandem.db"),
        str(home / "files" / secret["id"] / "alice_secret.py"),
    ]
    port = int(svc.url.rsplit(":", 1)[1])
    source = HOSTILE.format(targets=targets, port=port, marker=str(marker))
    module = upload(mallory, "hostile.py", source.encode())
    yield {"mallory": mallory, "module": module["id"], "path": str(home / "files" / module["id"] / "hostile.py"),
           "pid": api_pid, "marker": marker, "token": (home / "admin_token").read_text().strip()}  # fmt: skip
    alice.close()
    mallory.close()


def _never_imported_by_the_api(world) -> None:
    assert not (world["marker"] / f"imported-{world['pid']}").exists()


def test_this_host_sandboxes_user_code():
    assert probe()[0] is not None, probe()[1]


def test_a_validated_reward_reads_nothing_and_reaches_nothing(world):
    body = {"function": f"{world['module']}:score", "rows": [{"response": "1"}]}
    scored = world["mallory"].post("/v1/rewards/validate", json=body)
    assert scored.status_code == 200, scored.text
    assert scored.json()["scores"] == [1.0] and scored.json()["errors"] == 0, scored.json()
    _never_imported_by_the_api(world)


def test_an_error_carries_no_secret_back(world):
    body = {"function": f"{world['module']}:echo_token", "rows": [{"response": "1"}]}
    scored = world["mallory"].post("/v1/rewards/validate", json=body).json()
    message = " ".join(scored.get("error_messages", [])) or str(scored)
    assert "No such file" in message and world["token"] not in message and "tml-" not in message


@pytest.mark.parametrize(
    ("function", "why"),
    [
        ("spin", "did not finish|CPU time limit"),
        ("allocate", "MemoryError"),
        ("fork_bomb", "BlockingIOError|Resource"),
    ],
)
def test_resource_attacks_end_in_the_sandbox_and_the_service_stays_up(svc, world, function, why):
    import re

    started = time.monotonic()
    body = {"function": f"{world['module']}:{function}", "rows": [{"response": "1"}]}
    answer = world["mallory"].post("/v1/rewards/validate", json=body, timeout=120)
    assert answer.status_code in (200, 422), answer.text
    text = answer.text if answer.status_code == 422 else " ".join(answer.json()["error_messages"])
    assert re.search(why, text), text
    assert time.monotonic() - started < TIMEOUT_S + 30
    assert httpx.get(svc.url + "/healthz", timeout=5).status_code == 200


def test_submission_checks_import_the_module_in_the_sandbox_only(world):
    path = world["path"]
    bodies = {
        "reward.function": {"reward": {"function": f"{world['module']}:score"}},
        "rollout.environment": {"rollout": {"environment": f"{path}:Env"}},
        "rollout.external.agent": {"rollout": {"source": "external", "external": {"agent": f"{path}:agent"}}},
    }
    for param, body in bodies.items():
        checked = world["mallory"].post(
            "/v1/jobs/validate", json={"model": {"builtin": "tiny-qwen2"}, **body}
        )
        assert checked.status_code == 200, (param, checked.text)
    _never_imported_by_the_api(world)


def test_an_environment_as_workers_host_it_reads_nothing(world):
    make = environment_factory(EnvironmentConfig(environment=f"{world['path']}:Env", max_turns=1))
    env = make()
    try:
        assert env.reset({"prompt": "hi"}) == "clean"
        assert env.step("hello")[1] == 1.0
    finally:
        release([env])
        env.host.close()


def test_without_a_sandbox_user_code_is_refused_naming_the_field(world, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap here
    probe.cache_clear()
    try:
        body = {"function": f"{world['module']}:score", "rows": [{"response": "1"}]}
        refused = world["mallory"].post("/v1/rewards/validate", json=body)
        checked = world["mallory"].post(
            "/v1/jobs/validate", json=tiny_job(reward={"function": f"{world['module']}:score"})
        )
    finally:
        monkeypatch.undo()
        probe.cache_clear()
    for answer, param in ((refused, "function"), (checked, "reward.function")):
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert (error["param"], error["code"]) == (param, "user_code_refused")
        assert "bubblewrap" in error["message"] and "--unsandboxed-user-code" in error["message"]
    assert probe()[0] is not None


def test_a_jobs_reward_reads_nothing_during_training(world):
    job = world["mallory"].post("/v1/jobs", json=tiny_job(reward={"function": f"{world['module']}:score"},
                                                          trainer={"total_steps": 2}))  # fmt: skip
    assert job.status_code == 201, job.text
    final = wait_for(world["mallory"], job.json()["id"], TERMINAL, timeout_s=300)
    assert final["status"] == "succeeded", final
    rows = world["mallory"].get(f"/v1/jobs/{final['id']}/metrics", params={"keys": "reward/*"}).json()["data"]
    assert [r["values"]["reward/errors"] for r in rows] == [0.0, 0.0]
    samples = world["mallory"].get(f"/v1/jobs/{final['id']}/samples", params={"step": 1}).json()["data"]
    assert samples and all(s["reward"] == 1.0 for s in samples)  # 1.0: every read raised
    _never_imported_by_the_api(world)


@pytest.mark.slow
def test_an_agent_the_job_runs_reads_nothing_and_an_unbounded_call_is_refused(world):
    spec = tiny_job(
        model={"builtin": "tiny-qwen2-chat"},
        rollout={"source": "external", "free_cache_after_generate": False,
                 "external": {"group_size": 2, "trajectories_per_step": 4, "agent": f"{world['path']}:agent",
                              "agent_workers": 2}},
        trainer={"total_steps": 1, "val_every": 0, "samples_per_step": 2},
        checkpoint={"every": 0},
    )  # fmt: skip
    job = world["mallory"].post("/v1/jobs", json=spec)
    assert job.status_code == 201, job.text
    final = wait_for(world["mallory"], job.json()["id"], TERMINAL, timeout_s=300)
    assert final["status"] == "succeeded", final
    rows = world["mallory"].get(
        f"/v1/jobs/{final['id']}/metrics", params={"keys": "external/*,critic/score/mean"}
    )
    last = rows.json()["data"][-1]["values"]
    assert last["external/agent_failures"] == 0 and last["critic/score/mean"] == 1.0


def test_the_module_never_ran_in_the_api_process(world):
    _never_imported_by_the_api(world)
    assert os.getpid() == world["pid"]  # the service of these tests is this process
