"""The sandbox for user code: reward functions, environments and agents run in a child process under
bubblewrap (child.py), never in a service process: the system read-only, a copy of the user's code,
a private scratch folder, no network, an unprivileged uid, no secrets, and limits (limits.py). The
parent (channel.py) calls functions in it over JSON lines. Without bubblewrap, user code is refused
unless the operator allowed `--unsandboxed-user-code`.
"""
