"""The sandbox itself (workers/sandbox/): what code in it can see, reach and use, and how its errors,
time-outs and deaths come back. Real bubblewrap processes, no service."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from workers.sandbox.channel import Sandbox, SandboxCrashed, SandboxError, SandboxTimeout
from workers.sandbox.launch import probe, readable_roots, sandbox_env
from workers.sandbox.limits import Limits

MODES = ["drop", "userns"] if os.geteuid() == 0 else ["userns"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def secrets(tmp_path, monkeypatch):
    """A service home with an admin token, and secrets in the environment, as the service has them."""
    home = tmp_path / "home"
    (home / "files" / "file-000000000000").mkdir(parents=True)
    (home / "admin_token").write_text("tml-secret-token")
    (home / "files" / "file-000000000000" / "other.py").write_text("SECRET = 1\n")
    monkeypatch.setenv("TANDEM_HOME", str(home))
    monkeypatch.setenv("TANDEM_ADMIN_TOKEN", "tml-secret-token")
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret")
    return home


def run(box: Sandbox, code: str, timeout_s: float = 60) -> object:
    """The value of `code`'s last line `result = ...`, run in the sandbox."""
    return box.call("tests.sandbox_probes:run", [code], timeout_s)


def test_this_host_runs_a_sandbox():
    mode, why = probe()
    assert mode in MODES, why


@pytest.mark.parametrize("mode", MODES)
def test_the_view_holds_the_system_and_the_staged_code_only(secrets, tmp_path, mode):
    code = tmp_path / "mod.py"
    code.write_text("def score(*a):\n    return 1.0\n")
    with Sandbox([code], mode=mode) as box:
        staged = box.place(f"{code}:score").rpartition(":")[0]
        seen = run(
            box,
            f"""
import os, pathlib
def can_read(p):
    try:
        pathlib.Path(p).read_bytes()
        return True
    except OSError:
        return False
def can_write(p):
    try:
        pathlib.Path(p).write_text("x")
        return True
    except OSError:
        return False
result = dict(
    uid=os.getuid(), pid=os.getpid(), cwd=os.getcwd(), home=os.environ.get("HOME"),
    token=can_read({str(secrets / "admin_token")!r}), other=can_read({str(secrets / "files/file-000000000000/other.py")!r}),
    original=can_read({str(code)!r}), staged=can_read({staged!r}), staged_write=can_write({staged!r}),
    source_write=can_write({str(REPO / "pyproject.toml")!r}), scratch_write=can_write("/scratch/x"),
    root=sorted(os.listdir("/root")) if os.path.isdir("/root") else [],
    env=sorted(os.environ),
)""",
        )
    assert seen["uid"] not in (0, os.getuid()) and seen["pid"] < 10  # its own uid and pid namespace
    assert (seen["cwd"], seen["home"]) == ("/scratch", "/scratch")
    assert not seen["token"] and not seen["other"] and not seen["original"]
    assert seen["staged"] and not seen["staged_write"] and not seen["source_write"] and seen["scratch_write"]
    bound = {p.relative_to("/root").parts[0] for p in readable_roots() if p.is_relative_to("/root")}
    assert set(seen["root"]) <= bound  # only the way to a Python installation kept there
    assert set(seen["env"]) - {"PWD"} == set(sandbox_env()), "an allow-list: no TANDEM_*, tokens or keys"


@pytest.mark.parametrize("mode", MODES)
def test_no_network_not_even_the_loopback(mode):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with Sandbox(mode=mode) as box:
            outcome = run(
                box,
                f"""
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=3).close()
    result = "connected"
except OSError as err:
    result = type(err).__name__
""",
            )
    assert outcome != "connected"


def test_a_spin_reaches_the_cpu_limit_and_says_so():
    with Sandbox(limits=Limits(cpu_s=1)) as box, pytest.raises(SandboxCrashed, match="CPU time limit"):
        run(box, "while True:\n    pass", timeout_s=120)


def test_memory_and_processes_are_bounded():
    with Sandbox(limits=Limits(memory_mb=512, processes=32)) as box:
        with pytest.raises(SandboxError, match="MemoryError"):
            run(box, "result = len(bytearray(10 * 1024**3))")
        with pytest.raises(SandboxError, match="BlockingIOError|Resource temporarily unavailable"):
            run(
                box,
                "import os\nfor _ in range(200):\n    if os.fork() == 0:\n        import time; time.sleep(60)",
            )
        try:  # served, or refused for want of a thread while the bomb's remains hold the limit
            assert run(box, "result = 'served'") == "served"
        except SandboxError as err:
            assert "can't start new thread" in str(err)
        assert box.alive


def test_a_call_past_its_time_limit_ends_the_sandbox():
    box = Sandbox()
    try:
        with pytest.raises(SandboxTimeout, match="within 1 s"):
            run(box, "import time\ntime.sleep(60)", timeout_s=1)
        assert not box.alive
        with pytest.raises(SandboxCrashed):
            run(box, "result = 1")
    finally:
        box.close()


def test_errors_are_bounded_and_prints_do_not_garble_the_channel():
    with Sandbox() as box:
        with pytest.raises(SandboxError) as raised:
            run(box, "print('x' * 100000)\nraise ValueError('y' * 100000)")
        assert raised.value.type == "ValueError" and len(str(raised.value)) <= 2000
        assert run(box, 'print(\'{"id": 1, "ok": 2}\')\nresult = 3') == 3
        with pytest.raises(SandboxCrashed, match="exit code 7"):
            run(box, "import os\nos._exit(7)")


def test_the_sandbox_asks_its_parent():
    asked = []

    def asker(topic, payload):
        asked.append((topic, payload))
        return {"answer": payload["n"] + 1}

    with Sandbox(asker=asker) as box:
        assert box.call("workers.sandbox.child:ask", ["add", {"n": 41}, 10], 30) == {"answer": 42}
    assert asked == [("add", {"n": 41})]


def test_without_bubblewrap_user_code_is_refused_unless_the_operator_allows_it(tmp_path):
    """PATH without bwrap: the probe fails; the single-user flag runs a plain child instead."""
    script = (
        "from workers.sandbox.launch import sandbox_mode, SandboxUnavailable\n"
        "try:\n    print(sandbox_mode().name)\nexcept SandboxUnavailable as err:\n    print('refused:', err)\n"
    )
    env = {"PATH": str(tmp_path), "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    refused = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert "refused:" in refused.stdout and "--unsandboxed-user-code" in refused.stdout, refused
    allowed = subprocess.run([sys.executable, "-c", script], env={**env, "TANDEM_UNSANDBOXED_USER_CODE": "1"},
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert allowed.stdout.strip() == "none", allowed
    with Sandbox(mode="none") as box:
        assert run(box, "import os\nresult = os.getpid()") != os.getpid()


def test_a_child_that_breaks_the_protocol_is_ended():
    with Sandbox() as box:
        with pytest.raises(SandboxCrashed, match="broke its protocol"):
            run(
                box,
                "from workers.sandbox import child\nchild._CHANNEL.send({'id': [1], 'ok': 2})\nimport time\ntime.sleep(30)",
            )
        assert not box.alive


def test_a_sandbox_outlives_the_thread_that_started_it():
    """bwrap's --die-with-parent follows the starting thread: a job's pool threads come and go."""
    import threading

    boxes = []
    starter = threading.Thread(target=lambda: boxes.append(Sandbox()))
    starter.start()
    starter.join()
    try:
        assert run(boxes[0], "result = 'alive'") == "alive"
    finally:
        boxes[0].close()


CALL_ID = "f = sys._getframe()\nwhile not isinstance(f.f_locals.get('message'), dict):\n    f = f.f_back\n"
HOSTILE_LINES = {  # written on the channel itself, as code in the sandbox can
    "nested past the parser": "b'[' * 100_000 + b'\\n'",
    "an error of megabytes": "json.dumps({'id': f.f_locals['message']['id'], "
    "'error': {'message': 'x' * 8_000_000, 'type': 'E' * 8_000_000}}).encode() + b'\\n'",
}


@pytest.mark.parametrize("line", HOSTILE_LINES.values(), ids=HOSTILE_LINES.keys())
def test_a_hostile_reply_ends_the_call_at_once_and_bounded(line):
    code = (
        f"import json, sys, time\nfrom workers.sandbox import child\n{CALL_ID}c = child._CHANNEL\n"
        f"with c.lock:\n    c.writer.write({line})\n    c.writer.flush()\ntime.sleep(30)"
    )
    with Sandbox() as box:
        with pytest.raises(SandboxError) as raised:
            run(box, code, timeout_s=10)
    assert not isinstance(raised.value, SandboxTimeout)  # the reader saw it: no wait for the limit
    assert len(raised.value.message) <= 2000 and len(raised.value.type) <= 2000


def test_a_flood_of_questions_is_refused_past_a_bound_not_queued():
    """Each queued question holds its line (up to 16 MB) in the parent: a sandbox asking without end
    must be told no at once, not queued until the parent runs out of memory."""
    release = threading.Event()

    def slow_asker(topic, payload):
        release.wait(5)
        return "late"

    flood = (
        "import threading\nfrom workers.sandbox.child import ask\nanswers = []\n"
        "def one():\n    try:\n        answers.append(ask('q', None, 3))\n"
        "    except Exception as err:\n        answers.append(str(err))\n"
        "threads = [threading.Thread(target=one) for _ in range(200)]\n"
        "[t.start() for t in threads]\n[t.join() for t in threads]\n"
        "result = sum('questions at once' in str(a) for a in answers)"
    )
    with Sandbox(asker=slow_asker) as box:
        refused = run(box, flood, timeout_s=30)
        release.set()
    assert refused >= 200 - 32
