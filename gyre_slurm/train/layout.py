"""Rank arithmetic for the training world (pure: no torch, no I/O).

Like torchtitan's ParallelDims: the train cells, in the order the coordinator lists them,
each hold `nodes_per_cell` nodes with `ranks_per_node` ranks each; ranks are numbered
cell by cell, node by node: rank = (cell position * nodes_per_cell + node) *
ranks_per_node + local rank. A model replica spans `tp * pp` consecutive ranks, which
must either fit inside one cell or be whole cells (so no replica straddles a cell
boundary and a handoff moves whole replicas); data parallelism runs across replicas:
dp = world_size / (tp * pp). Expert parallelism (MoE, expert TP 1, as Megatron's
order "tp-cp-ep-dp-pp" lays it out) splits each pipeline stage's world / pp ranks into
groups of `ep`: a world must be a multiple of ep * pp, and ep must divide the experts
(`expert_parallel_sizes`, `world_unit`).

A node is named by (cell_id, node index inside its cell). `plan_handoff` turns an old and
a new layout into what each node does at a rebuild: the ranks in the new world (its
first local rank's), which nodes join or leave, which old rank keeps the flushed
gradients (one that stays), and which new rank broadcasts weights and optimizer state (a
member of the old world). `runtime.world.TrainWorld.rebuild` follows it, listing the
members node by node (a layout of one-node units in the members' order, whose ranks are
the same).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gyre_slurm.models.memory import expert_parallel_sizes

__all__ = ["TrainLayout", "layout", "world_unit", "expert_parallel_sizes",
           "expert_parallel_fits", "HandoffPlan", "plan_handoff"]

Node = tuple[int, int]  # (cell_id, node index inside the cell)


@dataclass(frozen=True)
class TrainLayout:
    cells: tuple[int, ...]
    nodes_per_cell: int
    ranks_per_node: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if len(set(self.cells)) != len(self.cells):
            raise ValueError(f"a cell appears twice among the train cells: {self.cells}")
        if min(self.nodes_per_cell, self.ranks_per_node, self.tp, self.pp, self.ep) < 1:
            raise ValueError("nodes_per_cell, ranks_per_node, tp, pp and ep must be >= 1")
        if self.world_size % (self.ep * self.pp):
            raise ValueError(f"{self.world_size} ranks do not split into expert-parallel "
                             f"groups: ep*pp={self.ep * self.pp} must divide the world")
        replica, per_cell = self.tp * self.pp, self.ranks_per_cell
        if per_cell % replica and replica % per_cell:
            raise ValueError(f"a replica of tp*pp={replica} ranks must fit in a cell of "
                             f"{per_cell} ranks or be whole cells")
        if self.world_size % replica:
            raise ValueError(f"{self.world_size} ranks do not split into replicas of "
                             f"tp*pp={replica}")

    @property
    def ranks_per_cell(self) -> int:
        return self.nodes_per_cell * self.ranks_per_node

    @property
    def world_size(self) -> int:
        return len(self.cells) * self.ranks_per_cell

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def nodes(self) -> list[Node]:
        return [(c, n) for c in self.cells for n in range(self.nodes_per_cell)]

    def rank_of(self, node: Node, local_rank: int = 0) -> int:
        cell, index = node
        if cell not in self.cells or not 0 <= index < self.nodes_per_cell:
            raise KeyError(f"node {node} is not in this layout")
        if not 0 <= local_rank < self.ranks_per_node:
            raise KeyError(f"local rank {local_rank} out of range")
        position = self.cells.index(cell) * self.nodes_per_cell + index
        return position * self.ranks_per_node + local_rank

    def node_of(self, rank: int) -> tuple[Node, int]:
        """(node, local rank) of a rank."""
        if not 0 <= rank < self.world_size:
            raise KeyError(f"rank {rank} outside a world of {self.world_size}")
        position, local = divmod(rank, self.ranks_per_node)
        cell_pos, index = divmod(position, self.nodes_per_cell)
        return (self.cells[cell_pos], index), local

    def dp_rank(self, rank: int) -> int:
        return rank // (self.tp * self.pp)

    def node_ranks(self) -> dict[Node, int]:
        """The rank of each node (one rank per node)."""
        return {node: self.rank_of(node) for node in self.nodes}


def layout(cells: Sequence[int], *, nodes_per_cell: int, ranks_per_node: int = 1,
           tp: int = 1, pp: int = 1, ep: int = 1) -> TrainLayout:
    return TrainLayout(tuple(cells), nodes_per_cell, ranks_per_node, tp, pp, ep)


def world_unit(*, ranks_per_cell: int, tp: int = 1, pp: int = 1) -> int:
    """The ranks every training world is a multiple of: a cell's, or a replica's when a
    replica spans several cells."""
    return max(ranks_per_cell, tp * pp)


def expert_parallel_fits(ep: int, *, ranks_per_cell: int, tp: int = 1, pp: int = 1) -> bool:
    """Whether every world the elastic runtime can form (whole cells, whole replicas)
    holds expert parallelism `ep`: the smallest world, and so every multiple of it."""
    return world_unit(ranks_per_cell=ranks_per_cell, tp=tp, pp=pp) % (ep * pp) == 0


@dataclass(frozen=True)
class HandoffPlan:
    new_ranks: dict[Node, int]  # every node of the new world -> its rank
    joining: tuple[Node, ...]  # new members (need weights + optimizer state)
    leaving: tuple[Node, ...]  # old members not in the new world
    staying: tuple[Node, ...]
    keep_old_rank: int | None  # old rank that keeps the flushed gradients (None: no old world)
    src_rank: int | None  # new rank that broadcasts state (None: nobody holds it)


def plan_handoff(old: TrainLayout | None, new: TrainLayout) -> HandoffPlan:
    """What a rebuild from `old` to `new` asks of each node (ranks: its first local
    rank's)."""
    old_nodes = old.nodes if old is not None else []
    new_ranks = new.node_ranks()
    staying = tuple(n for n in old_nodes if n in new_ranks)
    keep = old.rank_of(staying[0]) if old is not None and staying else None
    return HandoffPlan(
        new_ranks=new_ranks,
        joining=tuple(n for n in new.nodes if n not in set(old_nodes)),
        leaving=tuple(n for n in old_nodes if n not in new_ranks),
        staying=staying,
        keep_old_rank=keep,
        src_rank=new_ranks[staying[0]] if staying else None,
    )
