"""A small typed HTTP client for the Tandem REST API, used by the `tandem` CLI and by scripts.

It connects to the URL given, else TANDEM_URL, else the service running on $TANDEM_HOME
(api/service_record.py), else http://127.0.0.1:8000, with the token given, else TANDEM_TOKEN, else
$TANDEM_HOME/admin_token. `stream` resumes a dropped Server-Sent Events stream from the last event id.
A redirect is an error, never followed: the token would go wherever it points.
"""

from __future__ import annotations

import ipaddress
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from api.service_record import read_record

DEFAULT_URL = "http://127.0.0.1:8000"
TIMEOUT = httpx.Timeout(30.0, connect=5.0)
# The server sends a heartbeat every 15 s on an idle stream: a minute of silence is a dead connection.
STREAM_TIMEOUT = httpx.Timeout(connect=5.0, read=60.0, write=10.0, pool=5.0)
RECONNECT_TRIES = 5

JSON = dict[str, Any]


class TandemError(Exception):
    """Anything the client could not do."""


class TandemAPIError(TandemError):
    """The API answered with an error: `status` is the HTTP status, `param` the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def is_bad_input(self) -> bool:
        """The request itself was wrong (a bad field or value), as opposed to a refusal or a fault."""
        return self.status in (400, 422)


class TandemConnectionError(TandemError):
    """The service could not be reached at `url`."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(
            f"cannot reach the Tandem service at {url} ({reason}); start it with `tandem serve`, "
            "or point TANDEM_URL at a running one"
        )
        self.url = url


@dataclass
class SSEEvent:
    """One Server-Sent Event: `data` is the decoded JSON payload."""

    id: int | None
    event: str
    data: Any


def client_home() -> Path:
    return Path(os.environ.get("TANDEM_HOME") or Path.home() / ".tandem").expanduser()


def resolve_url(url: str | None = None) -> str:
    """The service to call: the argument, else TANDEM_URL, else the home's running service, else 8000."""
    if url or os.environ.get("TANDEM_URL"):
        return (url or os.environ["TANDEM_URL"]).rstrip("/")
    record = read_record(client_home())
    return (record["url"] if record else DEFAULT_URL).rstrip("/")


def resolve_token(token: str | None = None) -> str | None:
    """The token to send: the argument, else TANDEM_TOKEN, else $TANDEM_HOME/admin_token if readable."""
    token = token or os.environ.get("TANDEM_TOKEN")
    if token:
        return token
    try:
        return (client_home() / "admin_token").read_text().strip() or None
    except OSError:
        return None


def parse_sse(lines: Iterable[str]) -> Iterator[SSEEvent]:
    """Events from the lines of a text/event-stream; comment lines (heartbeats) are skipped."""
    event_id: int | None = None
    name, data = "message", []
    for line in lines:
        if not line:
            if data:
                yield SSEEvent(event_id, name, json.loads("\n".join(data)))
            event_id, name, data = None, "message", []
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "id" and value.isdigit():
            event_id = int(value)
        elif field == "event":
            name = value
        elif field == "data":
            data.append(value)


class TandemClient:
    """The REST API as methods; each returns the decoded JSON body."""

    def __init__(self, url: str | None = None, token: str | None = None) -> None:
        self.url = resolve_url(url)
        headers = {"User-Agent": "tandem-cli"}
        resolved = resolve_token(token)
        if resolved:
            headers["Authorization"] = f"Bearer {resolved}"
        self.token_in_clear = bool(resolved) and not _private(httpx.URL(self.url))
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=TIMEOUT)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create_job(self, spec: JSON, idempotency_key: str | None = None) -> JSON:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self.call("POST", "/v1/jobs", json=spec, headers=headers)

    def validate_job(self, spec: JSON) -> JSON:
        """The service's checks of a submission, nothing created: {"valid": true, "spec": {...}} or an error."""
        return self.call("POST", "/v1/jobs/validate", json=spec)

    def list_jobs(self, status: list[str] | None = None, limit: int = 20, after: str | None = None,
                  q: str | None = None, tag: str | None = None) -> JSON:  # fmt: skip
        return self.call(
            "GET", "/v1/jobs", params={"limit": limit, "status": status, "after": after, "q": q, "tag": tag}
        )

    def get_job(self, job_id: str) -> JSON:
        return self.call("GET", f"/v1/jobs/{job_id}")

    def control(self, job_id: str, action: str) -> JSON:
        """`action` ("cancel", "pause" or "resume") the job; returns it as the service left it."""
        return self.call("POST", f"/v1/jobs/{job_id}/{action}")

    def fork(self, job_id: str, checkpoint_step: int | None = None, overrides: JSON | None = None) -> JSON:
        body = {"checkpoint_step": checkpoint_step, "overrides": overrides or {}}
        return self.call("POST", f"/v1/jobs/{job_id}/fork", json=body)

    def set_hyperparameters(self, job_id: str, changes: JSON) -> JSON:
        return self.call("PATCH", f"/v1/jobs/{job_id}/hyperparameters", json=changes)

    def events(self, job_id: str, after: int = 0, limit: int = 1000) -> JSON:
        return self.call("GET", f"/v1/jobs/{job_id}/events", params={"after": after, "limit": limit})

    def metrics(self, job_id: str, keys: list[str] | None = None, **query: int) -> JSON:
        """One page of the series; `query` takes the route's other parameters (after_step, last,
        every, max_points, step_min, step_max, limit)."""
        params = {**query, "keys": ",".join(keys or [])}
        return self.call("GET", f"/v1/jobs/{job_id}/metrics", params=params)

    def logs(self, job_id: str, tail: int = 200) -> JSON:
        return self.call("GET", f"/v1/jobs/{job_id}/logs", params={"tail": tail})

    def checkpoints(self, job_id: str) -> JSON:
        return self.call("GET", f"/v1/jobs/{job_id}/checkpoints")

    def samples(self, job_id: str, step: int | None = None, limit: int = 20, after: int = 0) -> JSON:
        params = {"limit": limit, "after": after, "step": step}
        return self.call("GET", f"/v1/jobs/{job_id}/samples", params=params)

    def stream(self, job_id: str, what: str, after: int = 0) -> Iterator[SSEEvent]:
        """A job's live `events`, `metrics` or `logs` after id `after`, until the `end` event."""
        path, last, failures = f"/v1/jobs/{job_id}/{what}/stream", after, 0
        while True:
            try:
                headers = {"Last-Event-ID": str(last), "Accept": "text/event-stream"}
                with self._http.stream("GET", path, headers=headers, timeout=STREAM_TIMEOUT) as response:
                    if response.is_error:
                        response.read()
                        raise _api_error(response)
                    for event in parse_sse(response.iter_lines()):
                        failures = 0
                        last = event.id if event.id is not None else last
                        yield event
                        if event.event == "end":
                            return
                reason = "the stream closed before the job ended"
            except (httpx.TransportError, json.JSONDecodeError) as err:
                reason = _reason(err)
            failures += 1
            if failures >= RECONNECT_TRIES:
                raise TandemConnectionError(self.url, reason)
            time.sleep(min(2.0**failures, 10.0) * 0.5)

    def upload_file(self, path: str | Path) -> JSON:
        """Upload a data file or a .py module; returns its record (its `id` is what specs name)."""
        path = Path(path)
        headers = {"content-type": "application/octet-stream"}
        with path.open("rb") as content:  # httpx sends a file in chunks, never whole
            return self.call("POST", "/v1/files", {"filename": path.name}, content=content, headers=headers)

    def call(self, method: str, path: str, params: JSON | None = None, **kwargs: Any) -> JSON:
        """Any route's decoded answer (the files' and keys' routes are called so); `params` left empty
        (None, "" or []) are not sent."""
        sent = {k: v for k, v in (params or {}).items() if v not in (None, "", [])}
        request = f"{method} {self.url}{path}"
        try:
            response = self._http.request(method, path, params=sent or None, **kwargs)
        except (httpx.ReadTimeout, httpx.WriteTimeout):
            raise TandemError(f"{request}: no answer within {self._http.timeout.read:g} s") from None
        except httpx.TransportError as err:
            raise TandemConnectionError(self.url, _reason(err)) from None
        if response.is_error:
            raise _api_error(response)
        return _decoded(response, request)


def every_page(page: Callable[[Any], JSON]) -> list[JSON]:
    """The rows of every page of a list: `page(after)` reads the one after the row id `after` (None: the first)."""
    rows: list[JSON] = []
    after = None
    while True:
        got = page(after)
        rows += got["data"]
        if not got["has_more"] or not got["data"]:
            return rows
        after = got["data"][-1]["id"]


def _decoded(response: httpx.Response, request: str) -> JSON:
    """A success's JSON object. A redirect is not followed: the token would go wherever it points."""
    if response.is_redirect:
        raise TandemError(f"{request} was redirected ({response.status_code}) to {response.headers.get('location')}; "
                          "not followed, so the token stays here: point TANDEM_URL at the service itself")  # fmt: skip
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        kind = response.headers.get("content-type") or "no content type"
        raise TandemError(f"{request}: the answer (HTTP {response.status_code}, {kind}) is not a JSON object; "
                          "is that URL a Tandem service?")  # fmt: skip
    return body


def _private(url: httpx.URL) -> bool:
    """Whether what is sent to `url` stays off the network: https, or plain http to this machine."""
    if url.scheme == "https" or url.host == "localhost":
        return True
    try:
        return ipaddress.ip_address(url.host).is_loopback
    except ValueError:
        return False


def _api_error(response: httpx.Response) -> TandemAPIError:
    try:
        error = response.json()["error"]
        return TandemAPIError(response.status_code, error["message"], error.get("param"), error.get("code"))
    except (ValueError, KeyError, TypeError):
        text = response.text.strip()[:200] or response.reason_phrase
        return TandemAPIError(response.status_code, f"HTTP {response.status_code}: {text}")


def _reason(err: Exception) -> str:
    if isinstance(err, httpx.TimeoutException):
        return "timed out"
    return str(err) or type(err).__name__
