"""Privileges: what a task may do to the rect it names, and which pairs of accesses conflict.

The vocabulary is closed, as in Legion: `read`, `write` (write-discard: prior contents are not
needed), `read_write`, and `reduce` with an operator (only `+` is used by the lowering). Two
accesses to overlapping rects conflict unless both are reads or both reduce with the same operator.
"""

from __future__ import annotations

from enum import Enum


class Privilege(str, Enum):
    READ = "read"
    WRITE = "write"
    READ_WRITE = "read_write"
    REDUCE = "reduce"

    def __str__(self) -> str:
        return self.value

    @property
    def reads(self) -> bool:
        return self in (Privilege.READ, Privilege.READ_WRITE)

    @property
    def writes(self) -> bool:
        return self is not Privilege.READ


def conflicts(earlier: Privilege, later: Privilege) -> bool:
    """Whether two accesses to overlapping data must be ordered."""
    commuting = (Privilege.READ, Privilege.REDUCE)
    return not (earlier is later and earlier in commuting)


def dependence_kind(earlier: Privilege, later: Privilege) -> str:
    """RAW, WAR or WAW for a conflicting pair.

    A reduction folds into the value already there, so a reduction after a write consumes that
    write (RAW), while a write after a reduction overwrites it (WAW).
    """
    consumes = later.reads or later is Privilege.REDUCE
    if consumes and earlier.writes:
        return "RAW"
    if earlier.reads and not earlier.writes:
        return "WAR"
    return "WAW"
