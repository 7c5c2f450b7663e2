"""The `tandem` CLI against what a hostile tenant can make it print.

A tenant writes log lines (their reward prints), events' and jobs' error messages (their code raises),
and samples (their data, their model's text); the admin reads every owner's jobs with the CLI. Escape
sequences in that text must reach the admin's terminal as visible escapes, not act on it. The service
runs without Ray: the tenant's text is put in its store as the workers would write it.
"""

from __future__ import annotations

import json

import pytest

from api import cli
from tests.owners_util import owned_job

# An OSC 52 clipboard write, a bell, a line erase with a carriage return, a backspace, a CSI in its
# one-byte C1 form, a right-to-left override, a NUL: each acts on a terminal that prints it raw.
HOSTILE = "ok\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2K\rdone\x08\x9b31m\u202egnp.exe\x00"
SHOWN = r"ok\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2K\rdone\x08\x9b31m\u202egnp.exe\x00"
RAW = set("\x1b\x07\r\x08\x9b\u202e\x00")


@pytest.fixture(scope="module")
def hostile_job(unscheduled) -> str:
    store = unscheduled.service.store
    job_id = owned_job(unscheduled, "mallory", checkpoint=False)
    store.update_job(job_id, error=f"reward raised: {HOSTILE}\nsucceeded")
    store.add_logs(job_id, [(2.0, "INFO", HOSTILE), (3.0, "INFO", f"one\n{HOSTILE}")])
    store.add_event(job_id, "reward_error", HOSTILE)
    turns = [{"role": "assistant", "content": f"first line\n{HOSTILE}"}]
    store.add_samples(job_id, 2, [{"prompt": HOSTILE, "turns": turns, "error": HOSTILE, "reward": 0.0}])
    return job_id


def run(svc, capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main([*argv, "--url", svc.url, "--token", svc.token])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv",
    [("status",), ("logs",), ("events",), ("samples", "--step", "2")],
    ids=["status", "logs", "events", "samples"],
)
def test_a_tenants_escape_sequences_reach_the_admins_terminal_escaped(unscheduled, hostile_job, capsys, argv):
    command, *rest = argv
    code, out, err = run(unscheduled, capsys, command, hostile_job, *rest)
    assert code == 0, err
    assert not RAW & set(out + err), repr(out)
    assert SHOWN in out


def test_one_line_fields_stay_on_one_line_and_multi_line_text_keeps_its_lines(
    unscheduled, hostile_job, capsys
):
    _, out, _ = run(unscheduled, capsys, "status", hostile_job)
    error = next(line for line in out.splitlines() if line.startswith("error"))
    assert error.endswith(f"reward raised: {SHOWN}\\nsucceeded")  # no forged line after it
    _, out, _ = run(unscheduled, capsys, "logs", hostile_job)
    assert out.splitlines()[-1] == f"one\\n{SHOWN}"  # a log row is one line
    _, out, _ = run(unscheduled, capsys, "samples", hostile_job, "--step", "2")
    assert f"[assistant] first line\n{SHOWN}\n" in out  # a model's text keeps its line breaks
    _, out, _ = run(unscheduled, capsys, "samples", hostile_job, "--step", "2", "--json")
    assert out.isascii() and json.loads(out)[0]["prompt"] == HOSTILE  # --json: the text exactly, escaped
