"""Where a job's experiment trackers may send its records: the operator's allow-list.

Trackers use the service's own credentials, so a spec may not choose a destination the operator has
not named: MLflow writes to a folder the owner may write, or posts to an allowed http(s) host (none by
default, not even this machine's); other schemes reach a store or account of the service's. W&B needs
`tandem serve --allow-wandb`.
"""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

from service.errors import ServiceError

HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")
LOCAL_SCHEMES = ("file",)
SERVER_SCHEMES = ("http", "https")


class TrackerRefused(ServiceError, ValueError):
    """A tracker destination the operator does not allow (422); `param` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(f"{param}: {message}", 422, param, "tracker_not_allowed")


def host_entry(entry: str) -> str:
    """An allow-list entry, 'host' or 'host:port', lower-cased; ValueError when it is neither."""
    host, sep, port = entry.strip().lower().partition(":")
    if not HOST.match(host) or (sep and not (port.isdigit() and 0 < int(port) < 65536)):
        raise ValueError(f"tracker host '{entry}' must be 'host' or 'host:port' (letters, digits, '.', '-')")
    return f"{host}:{int(port)}" if sep else host


@dataclass(frozen=True)
class TrackerPolicy:
    hosts: frozenset[str] = frozenset()  # host_entry() forms: 'host' (any port) or 'host:port'
    wandb: bool = False

    @classmethod
    def of(cls, hosts: list[str], wandb: bool) -> TrackerPolicy:
        return cls(frozenset(host_entry(h) for h in hosts), wandb)

    def check_loggers(self, loggers: list[str]) -> None:
        if "wandb" in loggers and not self.wandb:
            raise TrackerRefused(
                "wandb would log in with this service's own W&B account, which the operator has not allowed "
                "(tandem serve --allow-wandb); use tensorboard or mlflow, whose records stay in the job's folder",
                "trainer.loggers",
            )

    def mlflow_folder(self, uri: str, param: str = "trainer.mlflow_uri") -> str | None:
        """The local folder `uri` names (to be checked as a path the owner writes to), or None for an
        allowed server; TrackerRefused for anything else."""
        if "://" not in uri and not uri.startswith("file:"):
            return uri  # a plain path (absolute or not: the path check says which)
        if any(c in uri for c in "\\\x00") or any(c.isspace() for c in uri):
            raise TrackerRefused(f"'{uri[:200]}' is not a usable URI", param)
        try:
            parts = urlsplit(uri)
        except ValueError:  # e.g. an unclosed '[' of an IPv6 host
            raise TrackerRefused(f"'{uri[:200]}' is not a usable URI", param) from None
        scheme = parts.scheme.lower()
        if scheme in LOCAL_SCHEMES:
            if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
                raise TrackerRefused(f"'{uri[:200]}' must be file:///ABSOLUTE/FOLDER", param)
            return urllib.request.url2pathname(parts.path)  # unquoted, as MLflow reads it
        if scheme not in SERVER_SCHEMES:
            raise TrackerRefused(
                f"scheme '{scheme}:' is not allowed; give an http(s) MLflow server the operator allows, or "
                "leave it unset (the runs stay in the job's folder)",
                param,
            )
        try:
            port = parts.port
        except ValueError:  # not a number, or out of range
            raise TrackerRefused(f"'{parts.netloc[:200]}' has no usable port", param) from None
        self._check_server(parts.netloc, parts.hostname, port, param)
        return None

    def _check_server(self, netloc: str, hostname: str | None, port: int | None, param: str) -> None:
        if "@" in netloc:
            raise TrackerRefused(
                "credentials do not belong in the URI (specs are readable); the operator sets "
                "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD for the service",
                param,
            )
        host = (hostname or "").lower()
        if not HOST.match(host):
            raise TrackerRefused(f"'{netloc[:200]}' is not a host name or IPv4 address", param)
        if host not in self.hosts and f"{host}:{port}" not in self.hosts:
            named = f"{host}:{port}" if port is not None else host
            raise TrackerRefused(
                f"MLflow server '{named}' is not one this service may send to; ask the operator to allow it "
                f"(tandem serve --allow-tracker-host {named}), or leave mlflow_uri unset to keep the runs in "
                "the job's folder",
                param,
            )
