"""What a sandbox may use, and whether user code may run without one; `tandem serve` passes the
operator's choices to job processes in the environment variables below."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

ENV_CPU_S = "TANDEM_SANDBOX_CPU_S"
ENV_MEMORY_MB = "TANDEM_SANDBOX_MEMORY_MB"
ENV_UNSANDBOXED = "TANDEM_UNSANDBOXED_USER_CODE"
DEFAULT_CPU_S = 60.0
DEFAULT_MEMORY_MB = 2048


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandbox's process (setrlimit in the child, before any user code)."""

    cpu_s: float | None = DEFAULT_CPU_S  # RLIMIT_CPU; None: only the callers' per-call time limits
    memory_mb: int | None = DEFAULT_MEMORY_MB  # RLIMIT_AS of each process in it
    processes: int = 256  # RLIMIT_NPROC: processes and threads (a fork bomb stops here)
    file_mb: int = 1024  # RLIMIT_FSIZE: the largest file it may write
    network: bool = False  # False: a network namespace of its own, with nothing in it

    def long_lived(self) -> Limits:
        """A job's sandbox serves calls for hours, each with its own time limit: no total CPU budget."""
        return replace(self, cpu_s=None)

    @classmethod
    def from_env(cls) -> Limits:
        """The operator's limits as `tandem serve` passed them (or the defaults)."""
        cpu = os.environ.get(ENV_CPU_S)
        memory = os.environ.get(ENV_MEMORY_MB)
        return cls(
            cpu_s=float(cpu) if cpu else DEFAULT_CPU_S,
            memory_mb=int(memory) if memory else DEFAULT_MEMORY_MB,
        )

    def to_env(self) -> dict[str, str]:
        """The environment variables `from_env` reads back (for job processes)."""
        return {ENV_CPU_S: str(self.cpu_s or ""), ENV_MEMORY_MB: str(self.memory_mb or "")}


def unsandboxed_allowed() -> bool:
    """Whether the operator allowed user code without a sandbox (`tandem serve --unsandboxed-user-code`)."""
    return os.environ.get(ENV_UNSANDBOXED, "").strip().lower() in ("1", "true", "yes")
