"""Which OpenEnv servers a job may use, decided from the reference alone (no OpenEnv import here).

"openenv:http://HOST:PORT" names a running server; the address is a tenant's, so hostile: HOST must
be loopback or a node of the service's Ray cluster, written as an address, with a port and nothing
else. A user-code reference may instead name an OpenEnv server app, which the job serves in a
sandbox (workers/environments/sandboxed.py).
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

from workers.references import OPENENV_PREFIX

SCHEMES = {"http": "ws", "ws": "ws", "https": "wss", "wss": "wss"}
LOOPBACK = {"127.0.0.1", "::1", "localhost"}
MAX_REF_CHARS = 300
APP_ROUTES = {"/ws", "/reset", "/step", "/schema"}  # what every OpenEnv server app serves


def is_openenv_url(ref: Any) -> bool:
    return isinstance(ref, str) and ref.startswith(OPENENV_PREFIX)


def openenv_url_problem(ref: str, cluster: set[str] | None = None) -> str | None:
    """Why "openenv:URL" may not be used here, or None. `cluster`: the nodes' addresses (None: ask Ray)."""
    try:
        openenv_ws_url(ref, cluster)
    except ValueError as err:
        return str(err)
    return None


def openenv_ws_url(ref: str, cluster: set[str] | None = None) -> str:
    """The WebSocket base URL ("ws://HOST:PORT") that "openenv:URL" names; ValueError saying why not."""
    shown = ref[:MAX_REF_CHARS]
    if len(ref) > MAX_REF_CHARS:
        raise ValueError(f"environment '{shown}...' is longer than {MAX_REF_CHARS} characters")
    url = ref[len(OPENENV_PREFIX) :]
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise ValueError(f"environment '{shown}': not a URL ({err})") from None
    if parts.scheme not in SCHEMES or not parts.hostname:
        raise ValueError(
            f"environment '{shown}': expected 'openenv:http://HOST:PORT' (or ws://, https://, wss://)"
        )
    if parts.username or parts.password or parts.query or parts.fragment or parts.path not in ("", "/"):
        raise ValueError(f"environment '{shown}': only a scheme, a host and a port may be given")
    if port is None:
        raise ValueError(f"environment '{shown}': the server's port is missing")
    host = parts.hostname
    if host not in LOOPBACK:
        try:
            host = str(ipaddress.ip_address(host))
        except ValueError:
            raise ValueError(
                f"environment '{shown}': '{host}' is a name; give the server as 127.0.0.1 or the address "
                "of a node of this service's cluster"
            ) from None
        if host not in (cluster_addresses() if cluster is None else cluster):
            raise ValueError(
                f"environment '{shown}': {host} is neither 127.0.0.1 nor a node of this service's cluster; "
                "an OpenEnv server must run on one of them"
            )
    netloc = f"[{host}]" if ":" in host else "127.0.0.1" if host == "localhost" else host
    return f"{SCHEMES[parts.scheme]}://{netloc}:{port}"


def cluster_addresses() -> set[str]:
    """Loopback and the alive nodes of the Ray cluster this process is connected to."""
    addresses = {"127.0.0.1", "::1"}
    try:
        import ray

        if ray.is_initialized():
            addresses |= {str(n["NodeManagerAddress"]) for n in ray.nodes() if n.get("Alive")}
    except Exception:  # no Ray here, or its GCS did not answer: loopback only
        pass
    return addresses


def is_openenv_app(obj: Any) -> bool:
    """Whether `obj` is an OpenEnv server app: an ASGI app with OpenEnv's routes."""
    routes = getattr(obj, "routes", None)
    if not callable(obj) or not isinstance(routes, list):
        return False
    return APP_ROUTES <= {getattr(route, "path", None) for route in routes}
