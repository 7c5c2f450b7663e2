"""Fused element-wise kernels for the CPU training engine (cpu_kernels.c): SwiGLU, RMSNorm, rotary
embedding and the head's log-softmax, forward and backward, each reading its inputs once.

Compiled on first use (`CC`, else cc / gcc; -march=native) and cached by a hash of source, flags,
compiler and CPU (`TANDEM_KERNEL_CACHE`). Compiled with -ffast-math but linked without it, so
denormals are not switched to zero process-wide. Without a compiler, on a failed build or with
`TANDEM_CPU_KERNELS=0`, `kernels()` is None and callers run their eager path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import types
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_suffix(".c")
COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC"]
BUILD_TIMEOUT_S = 120.0


class CpuKernels:
    """The compiled library, called on contiguous fp32 CPU tensors."""

    def __init__(self, path: Path) -> None:
        self.lib, self.path = ctypes.CDLL(str(path)), path
        self.lib.tandem_max_threads.restype = ctypes.c_int

    def _call(self, name: str, *args: object) -> None:
        """tandem_<name>(*args) in C's types: a tensor as its data pointer, None as NULL, a bool as an
        int, an int as an int64, a float as a float (ctypes arrays as they are)."""
        getattr(self.lib, f"tandem_{name}")(*(_c_value(a) for a in args))

    def swiglu_forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(gate)
        self._call("swiglu_forward", gate, up, out, gate.numel())
        return out

    def swiglu_backward(
        self, grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
        self._call("swiglu_backward", grad.contiguous(), gate, up, grad_gate, grad_up, gate.numel())
        return grad_gate, grad_up

    def rms_norm_forward(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, rstd): rstd has one value per row of x's last dimension."""
        width = x.shape[-1]
        rows = x.numel() // width
        y, rstd = torch.empty_like(x), torch.empty(rows, dtype=x.dtype)
        self._call("rms_norm_forward", x, weight, y, rstd, rows, width, float(eps))
        return y, rstd

    def rms_norm_backward(
        self, grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        width = x.shape[-1]
        grad_x = torch.empty_like(x)
        parts = torch.empty(self.lib.tandem_max_threads(), width, dtype=x.dtype)
        self._call(
            "rms_norm_backward", grad.contiguous(), x, weight, rstd, grad_x, parts, x.numel() // width, width
        )
        return grad_x, parts.sum(0)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
        """x (at most 4-D, last dim contiguous) rotated by cos and sin broadcast to it; laid out as x."""
        y = torch.empty_like(x)
        views = [t.expand_as(x) for t in (x, cos, sin, y)]
        views = [t.reshape((1,) * (4 - t.dim()) + tuple(t.shape)) if t.dim() < 4 else t for t in views]
        dims = (ctypes.c_int64 * 4)(*views[0].shape)
        strides = (ctypes.c_int64 * 12)(*(s for t in views for s in t.stride()[:3]))
        self._call("rotary", x, cos, sin, y, dims, strides, inverse)
        return y

    def log_softmax_stats(
        self, logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool, write_log_p: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(log p of the targets, log-normaliser, entropy or None) per row of fp32 logits [rows, V];
        `write_log_p` overwrites the logits with the log-softmax."""
        rows, vocab = logits.shape
        targets = _checked_targets(targets, vocab)
        log_prob, lse = torch.empty(rows), torch.empty(rows)
        entropy = torch.empty(rows) if with_entropy else None
        self._call(
            "log_softmax_stats", logits, targets, log_prob, lse, entropy, rows, vocab, int(write_log_p)
        )
        return log_prob, lse, entropy

    def log_softmax_grad(
        self,
        values: torch.Tensor,
        shift: torch.Tensor | None,
        targets: torch.Tensor,
        grad_log_prob: torch.Tensor | None,
        entropy: torch.Tensor | None,
        grad_entropy: torch.Tensor | None,
    ) -> None:
        """Overwrite rows of log p + shift (None: log p) with the loss's gradient w.r.t. the logits."""
        rows, vocab = values.shape
        shift, grad_log_prob, entropy, grad_entropy = (
            None if t is None else t.reshape(-1).contiguous()
            for t in (shift, grad_log_prob, entropy, grad_entropy)
        )
        targets = _checked_targets(targets, vocab)
        self._call(
            "log_softmax_grad", values, shift, targets, grad_log_prob, entropy, grad_entropy, rows, vocab
        )


def _c_value(arg: object) -> object:
    if isinstance(arg, torch.Tensor):
        return ctypes.c_void_p(arg.data_ptr())
    if isinstance(arg, bool):
        return ctypes.c_int(arg)
    if isinstance(arg, int):
        return ctypes.c_int64(arg)
    if isinstance(arg, float):
        return ctypes.c_float(arg)
    return arg


def _checked_targets(targets: torch.Tensor, vocab: int) -> torch.Tensor:
    """int64, contiguous, each id inside the vocabulary (the kernels index rows by them)."""
    targets = targets.to(torch.int64).contiguous()
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise IndexError(
            f"target ids must be in [0, {vocab}); got {int(targets.min())}..{int(targets.max())}"
        )
    return targets


def rotary_fits(x: torch.Tensor, *broadcast: torch.Tensor) -> bool:
    """Whether `CpuKernels.rotary` takes these tensors (fp32 CPU, no autocast, <= 4-D, even last dim)."""
    tensors = (x, *broadcast)
    if torch.is_autocast_enabled("cpu") or x.dim() > 4 or x.shape[-1] % 2:
        return False
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return False
    try:
        views = [t.expand_as(x) for t in broadcast]
    except RuntimeError:
        return False
    return all(t.stride(-1) == 1 for t in (x, *views))


def kernels() -> CpuKernels | None:
    """The kernels for this machine, built on first use; None where they cannot be (logged once)."""
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return None
    return _loaded()


@functools.cache
def _loaded() -> CpuKernels | None:
    return _build_and_load()  # once a process (two threads at once build into one atomic rename)


def fits(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: fp32, contiguous, on a CPU, outside autocast."""
    return not torch.is_autocast_enabled("cpu") and all(
        t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors
    )


def install_forward(
    model: torch.nn.Module, classes: frozenset[str], forward: Callable, when: Callable = bool
) -> int:
    """Bind `forward` to each module of `model` whose class is in `classes` and for which `when` holds
    (a method, so a deep copy binds its copy), unless it has its own already; returns how many."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in classes and "forward" not in vars(module) and when(module):
            module.forward = types.MethodType(forward, module)
            count += 1
    return count


def _build_and_load() -> CpuKernels | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: the CPU engine runs its element-wise work in eager PyTorch")
        return None
    try:
        path = _cache_dir() / f"tandem_kernels_{_build_key(compiler)}.so"
        if not path.exists():
            _compile(compiler, path)
        return CpuKernels(path)
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("the CPU kernels did not build (%s): the element-wise work runs in eager PyTorch", err)
        return None


def _cache_dir() -> Path:
    folder = Path(os.environ.get("TANDEM_KERNEL_CACHE") or Path.home() / ".cache" / "tandem" / "kernels")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _build_key(compiler: str) -> str:
    """Source, flags, compiler and CPU: a cache on a shared home never serves another CPU."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (" ".join(COMPILE_FLAGS), version, _cpu_signature()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _cpu_signature() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    wanted = ("model name", "flags")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _compile(compiler: str, path: Path) -> None:
    """Compile with -ffast-math, link without it, rename into place (ranks never load half a file)."""
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        obj, lib = Path(tmp) / "kernels.o", Path(tmp) / "kernels.so"
        for command in (
            [compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
            [compiler, "-shared", "-fopenmp", str(obj), "-o", str(lib), "-lm"],
        ):
            done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            if done.returncode != 0:
                raise OSError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()[:500]}")
        os.replace(lib, path)
