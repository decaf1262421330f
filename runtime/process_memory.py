"""What the operating system says this process holds: its resident set now and at its peak.

Both come from /proc/self/status (`VmRSS`, and `VmHWM`, the kernel's high-water mark of this
program's address space), so they are the whole process's: ranks run as threads of one process
share them. The peak is not `getrusage`'s `ru_maxrss`: Linux carries that across `exec` from
the process that forked this one, so a rank started from a large process (a benchmark, a test)
would report its parent's peak. Where /proc is missing, `ru_maxrss` is all there is.
"""

from __future__ import annotations

import resource


def _status(field: str) -> int | None:
    """A `kB` field of /proc/self/status in bytes, or None where /proc does not say."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """The resident set now (`VmRSS`), or 0 where /proc does not say."""
    return _status("VmRSS") or 0


#: the highest peak read so far: the kernel folds each thread's cached page counts into the
#: process's lazily, so two readings can go back by a few dozen pages
_highest = 0


def peak_rss_bytes() -> int:
    """The most this process has held resident since it started (`VmHWM`)."""
    global _highest
    peak = _status("VmHWM")
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    _highest = max(_highest, peak)
    return _highest
