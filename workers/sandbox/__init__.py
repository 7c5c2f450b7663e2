"""The sandbox for user code: reward functions, environments and agents run in a child process under
bubblewrap, never in a service process.

The child (child.py) sees the system read-only, a copy of the user's code and a private scratch
folder, not the service home, other owners' files or the network; it runs as an unprivileged uid
with no secrets in its environment, under CPU, memory and process limits (limits.py). The parent
(channel.py) calls the service's own functions in it over JSON lines; nothing is unpickled. Where
bubblewrap cannot run, user code is refused unless the operator allowed `--unsandboxed-user-code`.
"""
