"""The sandbox for user code: reward functions, environments and agents run in a child process under
bubblewrap, never in a service process.

A sandbox (`Sandbox`, channel.py) is a Python child (child.py) that sees the system read-only (/usr,
the Python installation, the project's own source), a copy of the user's code file, and a private
scratch folder; not the service home, its store, other owners' uploads, /root, or the network (unless
a job allows it). It runs as an unprivileged uid with no service secrets in its environment, under
CPU-time, memory and process limits (limits.py), in its own process group, and dies with its parent.
The parent calls functions of the service's own code in it ("module:function", which then load the
user's reference there) over JSON lines on a pipe; the child may ask the parent things back (an agent's
HTTP requests). Nothing from the sandbox is unpickled, and its errors come back as a type and a bounded
message built from the user code's own traceback lines, never its raw output.

Where bubblewrap cannot run, user code is refused (`SandboxUnavailable`) unless the operator started
the service with `--unsandboxed-user-code` (launch.py decides, once per process, and says why).

Nothing here imports torch, Ray or the controller: the API, the job controller and workers use it.
"""
