"""One task's plan: its pieces, the transfers into it, its collectives, and who holds what after.

`partitioner.plan` makes them, a task at a time in program order (its docstring says how);
`partitioner.deferred_sums` leaves a task's sums to a later task's collective. Everything that
reads a plan (the cost model, `verify_plan`, the rank programs) reads these.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType

from legion_nn.rect import Rect
from partitioner.layout import Layout
from partitioner.pieces import Piece, PieceSet
from partitioner.strategy import Grid
from partitioner.transfers import Transfer, TransferBlock, TransferSet

#: the collective that copies each participant's part of a tensor to every other
ALLGATHER = "allgather"


@dataclass(frozen=True)
class Reduction:
    """A collective over `participants` of `targets` (rect, holders after): a sum of their
    partial sums (`allreduce`, `reduce_scatter`, `reduce`), or an `allgather`, each target
    copied from the one participant that holds it (`owners`) to every other
    (`partitioner.gathers`). A reduce-scatter may name its `contributors`: the participants
    whose partial sums it adds, the others (extras) taking part only to receive the targets
    they own (`core_places`)."""

    tensor: str
    algorithm: str
    participants: tuple[int, ...]
    targets: tuple[tuple[Rect, tuple[int, ...]], ...]
    itemsize: int
    #: an all-gather's: per target, the participant that holds it before
    owners: tuple[int, ...] = ()
    #: a reduce-scatter's participants that add partial sums, where not all do
    contributors: tuple[int, ...] = ()

    @property
    def gathers(self) -> bool:
        return self.algorithm == ALLGATHER

    @property
    def target_owners(self) -> tuple[int, ...]:
        """Per target, the participant holding it before an all-gather, or its first holder
        after a sum."""
        return self.owners or tuple(holders[0] for _, holders in self.targets)

    @property
    def summed_from(self) -> tuple[int, ...]:
        """The participants whose partial sums it adds (a sum's)."""
        return self.contributors or self.participants

    @cached_property
    def core_places(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(the ranks a reduce-scatter or an all-gather runs among, and per target the one of
        them it ends, or starts, at): a reduce-scatter's contributors, an all-gather's receivers
        (the ranks it leaves holding every target). A target's owner where the owner is one of
        them; else the owner is an extra participant, which holds parts but neither adds to
        them nor reads them: a partner among them, the k-th extra's the (k mod r)-th of the r,
        hands it its sums at the end, or takes its parts first. Found once: its price and its
        schedule (`partitioner.collectives`) read it several times each."""
        core = self.targets[0][1] if self.gathers else self.summed_from
        owners = self.target_owners
        if len(core) == len(self.participants):
            return core, owners
        inside = set(core)
        extras = [rank for rank in self.participants if rank not in inside]
        partner = {rank: core[k % len(core)] for k, rank in enumerate(extras)}
        return core, tuple(partner.get(owner, owner) for owner in owners)

    @cached_property
    def nbytes(self) -> int:
        return sum(rect.volume for rect, _ in self.targets) * self.itemsize


class TaskPlan:
    """One task's pieces, incoming transfers, gathers and reductions, and who holds what after.

    The arrays are the plan: `piece_sets`, `transfer_set`, `gathered` (fetches that arrive by
    an all-gather rather than as copies: `partitioner.gathers`), and `holdings`, the layout
    after the task of every tensor it writes or reduces into. `pieces` and `transfers` are
    read-only views of the arrays, made when first read; an edited plan is a new `TaskPlan`
    (`with_transfers`), so whatever reads it, arrays or objects, reads the same."""

    def __init__(
        self,
        task: str,
        unit: str,
        grid: Grid | None,
        piece_sets: Sequence[PieceSet],
        transfer_set: TransferSet,
        reductions: Sequence[Reduction] = (),
        holdings: Mapping[str, Layout] | None = None,
        deferred: Mapping[str, int] | None = None,
        gathered: Sequence[tuple[TransferBlock, Reduction]] = (),
    ) -> None:
        self.task = task
        self.unit = unit
        self.grid = grid
        self.piece_sets = tuple(piece_sets)
        self.transfer_set = transfer_set
        self.reductions = tuple(reductions)
        self.holdings: Mapping[str, Layout] = MappingProxyType(dict(holdings or {}))
        #: per tensor whose sum here waits for a later task's collective, that task's index
        #: (`partitioner.deferred_sums`): each rank adds its part into its own copy meanwhile
        self.deferred: Mapping[str, int] = MappingProxyType(dict(deferred or {}))
        #: per fetch that an all-gather brings: the copies it stands for (what each rank
        #: receives, for the memory count and `verify_plan`) and the collective
        self.gathered = tuple(gathered)

    @cached_property
    def pieces(self) -> tuple[Piece, ...]:
        return tuple(p for s in self.piece_sets for p in s.pieces())

    @property
    def collectives(self) -> list[Reduction]:
        """Its collectives in the order it runs them: the all-gathers that bring its reads,
        then its sums."""
        return [gather for _, gather in self.gathered] + list(self.reductions)

    @cached_property
    def transfers(self) -> tuple[Transfer, ...]:
        return tuple(self.transfer_set.transfers())

    def with_transfers(self, transfers: Iterable[Transfer]) -> TaskPlan:
        """This task's plan with `transfers` in place of its own (for tests of `verify_plan`)."""
        return TaskPlan(
            self.task,
            self.unit,
            self.grid,
            self.piece_sets,
            TransferSet.from_transfers(transfers),
            self.reductions,
            self.holdings,
            self.deferred,
            self.gathered,
        )

    def with_deferred(self, deferred: Mapping[str, int]) -> TaskPlan:
        """This task's plan with its sums into the tensors of `deferred` left to the later
        tasks it names (their reductions dropped here)."""
        return TaskPlan(
            self.task,
            self.unit,
            self.grid,
            self.piece_sets,
            self.transfer_set,
            [r for r in self.reductions if r.tensor not in deferred],
            self.holdings,
            {**self.deferred, **deferred},
            self.gathered,
        )

    def __repr__(self) -> str:
        pieces = sum(len(s) for s in self.piece_sets)
        transfers = sum(len(b) for b in self.transfer_set.blocks)
        return (
            f"TaskPlan({self.task!r}, unit={self.unit!r}, grid={self.grid}, pieces={pieces}, "
            f"transfers={transfers}, reductions={len(self.reductions)})"
        )
