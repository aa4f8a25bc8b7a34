"""Host memory of CPU training: let glibc's malloc keep freed blocks for reuse.

A CPU training step allocates and frees the same large tensors every step. glibc serves each block
above its mmap threshold (at most 32 MiB) with a fresh `mmap` and returns it with `munmap` when the
tensor dies, so the next step faults every page in again, zero-filled by the kernel: hundreds of
thousands of page faults per step for a spiking transformer at batch 16, a tenth or more of the
step's CPU time (BENCHMARKS.md `## memory`, "Host memory"). With mmap off and the heap's top never
trimmed, a freed block goes back to malloc's free lists and the next step takes it from there.

The price: memory freed is not given back to the operating system while the process lives, the
heap fragments before it settles (peak RSS 3-16 % higher on the zoo's models at batch 16, 43 % for
SDT at batch 64, whose step it made 1.43x faster), and the setting is process-wide. Recipe key
`train.host_memory: reuse` (default `system`, glibc's own behaviour).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

MODES = ("system", "reuse")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name or "libc.so.6")
        lib.mallopt  # noqa: B018 - musl and other libcs have no mallopt
        lib.gnu_get_libc_version  # noqa: B018 - the parameters above are glibc's
    except (OSError, AttributeError):
        return None
    lib.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.mallopt.restype = ctypes.c_int
    return lib


def reuse_supported() -> bool:
    """Whether this process runs on glibc, whose malloc `keep_freed_memory` tunes."""
    return _libc() is not None


def keep_freed_memory() -> None:
    """From now on, serve large allocations from malloc's heap (no `mmap`) and never trim its top,
    so freed tensors are reused without page faults. Process-wide; memory freed stays with the
    process. Raises RuntimeError where the C library is not glibc (nothing is changed then)."""
    lib = _libc()
    if lib is None:
        raise RuntimeError(
            "host memory 'reuse' needs glibc's malloc (Linux with glibc); this platform's C library has no "
            "mallopt: set train.host_memory: system, or preload an allocator that caches (jemalloc, tcmalloc)"
        )
    # the trim threshold first: once mmap is off, a large free must not shrink the heap either
    if lib.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) != 1 or lib.mallopt(_M_MMAP_MAX, 0) != 1:
        raise RuntimeError("glibc's mallopt refused the host memory 'reuse' settings")


def apply(mode: str) -> None:
    """Apply host memory mode `mode` ("system": leave malloc as it is; "reuse": `keep_freed_memory`)."""
    if mode not in MODES:
        raise ValueError(f"host memory mode must be one of {MODES}, got {mode!r}")
    if mode == "reuse":
        keep_freed_memory()
