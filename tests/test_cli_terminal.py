"""The `tandem` CLI against what a hostile tenant, or a wrong TANDEM_URL, can make it print or do.

A tenant writes log lines (their reward prints), events' and jobs' error messages (their code raises),
and samples (their data, their model's text); the admin reads every owner's jobs with the CLI. Escape
sequences in that text must reach the admin's terminal as visible escapes, not act on it. The service
runs without Ray: the tenant's text is put in its store as the workers would write it.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from api import cli, client
from tests.api_util import free_port
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


@contextmanager
def http_server(answer) -> Iterator[tuple[str, list[dict]]]:
    """A plain HTTP server on 127.0.0.1 (not a Tandem service) answering every request with
    `answer(handler)`; yields its URL and the headers of each request it got."""
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(dict(self.headers))
            answer(self)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def reply(status: int, body: bytes, **headers: str):
    def answer(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **headers}.items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(body)

    return answer


def tandem_at(url: str, capsys, *argv: str) -> tuple[int, str]:
    code = cli.main([*argv, "--url", url, "--token", "tdm_secret"])
    return code, capsys.readouterr().err


def test_an_answer_that_is_not_json_is_one_error_naming_the_server_and_request(capsys):
    page = b"<html><body>\x1b]0;owned\x07Welcome to nginx</body></html>"
    with http_server(reply(200, page, **{"Content-Type": "text/html"})) as (url, _):
        code, err = tandem_at(url, capsys, "list")
    assert code == 1 and len(err.splitlines()) == 1, err
    assert f"GET {url}/v1/jobs" in err and "not a JSON object" in err and "text/html" in err


def test_a_redirect_to_another_host_is_not_followed_and_the_key_stays_home(capsys):
    with http_server(reply(200, b"{}")) as (elsewhere, got), \
            http_server(reply(307, b"", Location=elsewhere + "/v1/jobs")) as (url, _):  # fmt: skip
        code, err = tandem_at(url, capsys, "list")
    assert got == []  # nothing reached the other host, the key least of all
    assert code == 1 and len(err.splitlines()) == 1, err
    assert f"GET {url}/v1/jobs" in err and "307" in err and f"{elsewhere}/v1/jobs" in err


def test_a_service_that_never_answers_is_a_timeout_naming_the_request(capsys, monkeypatch):
    monkeypatch.setattr(client, "TIMEOUT", client.httpx.Timeout(0.5, connect=5.0))
    with socket.socket() as silent:  # accepts the connection (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        code, err = tandem_at(url, capsys, "status", "job-0123456789ab")
    assert code == 1 and len(err.splitlines()) == 1, err
    assert f"GET {url}/v1/jobs/job-0123456789ab" in err and "no answer within 0.5 s" in err


def test_a_token_sent_in_clear_to_another_host_is_warned_about(capsys):
    code = cli.main(["list", "--url", "http://192.0.2.1:9", "--token", "tdm_secret"])  # TEST-NET: unreachable
    err = capsys.readouterr().err
    assert code == 1
    assert "warning: sending the token over plain http to 192.0.2.1" in err.splitlines()[0]
    cli.main(["list", "--url", f"http://127.0.0.1:{free_port()}", "--token", "tdm_secret"])
    assert "warning" not in capsys.readouterr().err  # the local service over http is fine
