"""Giving freed host memory back once a re-form let go of the old world's state.

The old model, optimizer and snapshot buffers are unreachable once the new world's state
is in place, but two things keep their memory: an FSDP2 module sits in reference cycles
(its hooks), so its parameters wait for the cyclic garbage collector, and glibc keeps
freed blocks below its mmap threshold (up to 32 MB) in the process's heap. Without both,
a process stays as large as it was at the re-form's peak, and grows with every re-form.
A full collection takes about 0.2 s in a training process (hundreds of thousands of
objects), so the run does this once, at the first step boundary after a re-form, once that
step is counted and published: the re-form is over, and the next step starts 0.2 s later.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable


@functools.cache
def _trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim): nothing to give back
        return None


def give_back() -> bool:
    """Collect unreachable cycles and return the heap's free pages to the system; False
    where the C library cannot trim."""
    gc.collect()
    trim = _trim()
    return bool(trim is not None and trim(0))
