"""Keep freed host memory in the process instead of handing it back to the kernel at every free:
glibc maps large blocks fresh and unmaps them on free, so every CPU step would zero-fault the same
memory again. `malloc_tunables` asks for transparent huge pages unless the setting is named already.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
from functools import cache
from pathlib import Path

# mallopt parameter numbers, from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

# Above glibc's documented 32 MiB ceiling, which newer glibc accepts: head gradients and log-prob
# chunks are larger. mallopt takes a C int: both values stay under 2^31.
MMAP_THRESHOLD = 512 * 1024 * 1024
MMAP_THRESHOLD_FALLBACK = 32 * 1024 * 1024  # the documented ceiling
TRIM_THRESHOLD = 2047 * 1024 * 1024
TOP_PAD = 64 * 1024 * 1024
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "mallopt") else None  # musl and others have no mallopt


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory; False where not glibc."""
    libc = _libc()
    if libc is None:
        return False
    # A glibc that holds to the 32 MiB ceiling refuses the larger threshold: then 32 MiB.
    threshold = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 or (
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_FALLBACK) == 1
    )
    settings = ((M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    return threshold and all(libc.mallopt(param, value) == 1 for param, value in settings)


def minor_page_faults() -> int:
    """This process's minor page faults so far (memory mapped in without a disk read)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def malloc_tunables(existing: str | None) -> str:
    """GLIBC_TUNABLES for a worker: `existing` plus huge pages for malloc, unless it names them."""
    items = [item for item in (existing or "").split(":") if item]
    if not any(item.split("=", 1)[0] == HUGE_PAGES_TUNABLE for item in items):
        items.append(f"{HUGE_PAGES_TUNABLE}=1")
    return ":".join(items)


def transparent_huge_pages() -> str | None:
    """The kernel's transparent huge page mode ('always', 'madvise' or 'never'); None where unknown."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else None
