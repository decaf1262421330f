"""What the operating system says this process holds: its resident set now and at its peak.

The peak is the kernel's high-water mark (`getrusage`'s `ru_maxrss`, KiB on Linux), so it is the
whole process's: ranks run as threads of one process share it.
"""

from __future__ import annotations

import resource


def rss_bytes() -> int:
    """The resident set now (`VmRSS`), or 0 where /proc does not say."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss_bytes() -> int:
    """The most this process has held resident since it started."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
