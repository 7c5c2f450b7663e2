"""Keep freed host memory in the process instead of handing it back to the kernel at every free.

glibc's malloc serves a block of 128 KiB or more (its threshold rises with what is freed, up to
32 MiB) with a fresh mmap and returns it with munmap when it is freed. A training or decoding step
on the CPU allocates thousands of tensors of that size and frees them at once, so every step maps,
zero-fills and unmaps the same memory again (page faults that slow the step). `keep_freed_memory`
tells malloc to serve blocks below MMAP_THRESHOLD from its heap and to keep up to TRIM_THRESHOLD of
free memory at the heap's top, so the next step reuses pages that are already mapped.

The cost is memory: a rank holds up to TRIM_THRESHOLD more than it uses at the moment, and blocks
above MMAP_THRESHOLD (a large model's weights and gradients) are mapped and unmapped as before.

`malloc_tunables` adds `glibc.malloc.hugetlb=1` to a worker's GLIBC_TUNABLES (glibc reads it when
the process starts, so it goes in the actor's environment): malloc then asks for transparent huge
pages (madvise) on what it maps, so a block mapped afresh faults in 2 MiB at a time, not 4 KiB.
Where the kernel's THP setting is "never", or glibc is older than 2.35, the tunable does nothing. A
GLIBC_TUNABLES that already names `glibc.malloc.hugetlb` (0 opts out) is kept as it is.
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

# Above glibc's documented 32 MiB ceiling for the threshold, which glibc 2.36 accepts: a model's
# head gradients and log-prob chunks are larger than 32 MiB and would be mapped afresh each step.
# mallopt takes a C int: both values stay under 2^31.
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
    """Set glibc's malloc to keep freed memory (see the module docstring); False where not glibc."""
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
    """GLIBC_TUNABLES for a worker: `existing` with transparent huge pages for malloc added, unless
    it already says what to do about them."""
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
