"""Cells, roles and the cell table (pure: no I/O, no clock; time is passed in).

A cell is `cell_nodes` consecutive nodes of the allocation. Its role is one of
`rollout`, `train`, `draining` (leaving a role: runs finishing or moving, or the
current micro-batch finishing), `loading` (entering a role: engine release or start,
process-group rebuild, weights), or `failed`. A cell in transition knows its `target`.

Standalone cells never change role: the first `min_rollout_cells` cells always roll out,
the next `min_train_cells` always train; the rest form the elastic pool. The table
refuses any change that would break that, so floors hold by construction.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Iterable, Sequence


class Role(str, enum.Enum):
    ROLLOUT = "rollout"
    TRAIN = "train"
    DRAINING = "draining"
    LOADING = "loading"
    FAILED = "failed"

    def __str__(self) -> str:  # pragma: no cover - cosmetic
        return self.value


STABLE = (Role.ROLLOUT, Role.TRAIN)


class CellTableError(RuntimeError):
    """An illegal role change was asked of the cell table (a bug in the caller)."""


@dataclass(frozen=True)
class Cell:
    cell_id: int
    nodes: tuple[str, ...]
    standalone: bool
    role: Role
    target: Role | None = None  # where a draining/loading cell is heading
    since_s: float = 0.0  # when the cell entered its current role

    @property
    def heading(self) -> Role:
        """The stable role this cell has or is moving to (failed cells: FAILED)."""
        return self.target if self.target is not None else self.role


def split_cells(nodes: Sequence[str], cell_nodes: int) -> list[tuple[str, ...]]:
    """Consecutive groups of `cell_nodes` nodes, in allocation order."""
    if cell_nodes <= 0:
        raise ValueError(f"cell_nodes must be > 0, got {cell_nodes}")
    if not nodes or len(nodes) % cell_nodes:
        raise ValueError(
            f"{len(nodes)} nodes cannot be split into cells of {cell_nodes}; "
            "set cluster.cell_nodes to a divisor of the node count"
        )
    return [tuple(nodes[i : i + cell_nodes]) for i in range(0, len(nodes), cell_nodes)]


class CellTable:
    """The role of every cell, with the legal transitions between roles."""

    def __init__(self, cells: Iterable[Cell]):
        self._cells = {c.cell_id: c for c in cells}
        self._ordered: list[Cell] | None = None  # by cell id; None: to sort again
        self.check_invariants()

    @classmethod
    def build(cls, nodes: Sequence[str], *, cell_nodes: int, min_rollout_cells: int,
              min_train_cells: int, initial: Sequence[Role] | None = None,
              all_standalone: bool = False) -> "CellTable":
        groups = split_cells(nodes, cell_nodes)
        if min_rollout_cells + min_train_cells > len(groups):
            raise ValueError(
                f"floors need {min_rollout_cells + min_train_cells} cells, "
                f"only {len(groups)} exist"
            )
        cells = []
        for i, group in enumerate(groups):
            if i < min_rollout_cells:
                role, standalone = Role.ROLLOUT, True
            elif i < min_rollout_cells + min_train_cells:
                role, standalone = Role.TRAIN, True
            else:
                role = initial[i] if initial is not None else Role.ROLLOUT
                standalone = all_standalone
            cells.append(Cell(cell_id=i, nodes=group, standalone=standalone, role=role))
        return cls(cells)

    # -- queries ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._cells)

    def __getitem__(self, cell_id: int) -> Cell:
        return self._cells[cell_id]

    @property
    def cells(self) -> list[Cell]:
        return list(self._by_id())

    def _by_id(self) -> list[Cell]:
        """The cells by id, sorted once per change (the simulator asks at every event)."""
        if self._ordered is None:
            self._ordered = [self._cells[i] for i in sorted(self._cells)]
        return self._ordered

    def ids(self, role: Role, *, target: Role | None = None) -> list[int]:
        return [c.cell_id for c in self._by_id()
                if c.role is role and (target is None or c.target is target)]

    def heading_to(self, role: Role) -> list[int]:
        return [c.cell_id for c in self._by_id() if c.heading is role]

    # -- transitions -----------------------------------------------------------------
    def begin_handoff(self, cell_id: int, to_role: Role, *, now_s: float) -> Cell:
        """Start moving a stable elastic cell to the other stable role (it drains first)."""
        cell = self._cells[cell_id]
        if to_role not in STABLE:
            raise CellTableError(f"cell {cell_id}: cannot hand off to {to_role}")
        if cell.standalone:
            raise CellTableError(f"cell {cell_id} is standalone ({cell.role}); it never moves")
        if cell.role not in STABLE or cell.role is to_role:
            raise CellTableError(f"cell {cell_id} is {cell.role}, cannot start a handoff to {to_role}")
        return self._set(replace(cell, role=Role.DRAINING, target=to_role, since_s=now_s))

    def cancel_drain(self, cell_id: int, *, now_s: float) -> Cell:
        """A draining cell goes back to the role it was leaving (nothing was torn down)."""
        cell = self._cells[cell_id]
        if cell.role is not Role.DRAINING:
            raise CellTableError(f"cell {cell_id} is {cell.role}, not draining")
        back = Role.TRAIN if cell.target is Role.ROLLOUT else Role.ROLLOUT
        return self._set(replace(cell, role=back, target=None, since_s=now_s))

    def begin_loading(self, cell_id: int, *, now_s: float) -> Cell:
        cell = self._cells[cell_id]
        if cell.role is not Role.DRAINING:
            raise CellTableError(f"cell {cell_id} is {cell.role}, not draining")
        return self._set(replace(cell, role=Role.LOADING, since_s=now_s))

    def finish_handoff(self, cell_id: int, *, now_s: float) -> Cell:
        cell = self._cells[cell_id]
        if cell.role is not Role.LOADING:
            raise CellTableError(f"cell {cell_id} is {cell.role}, not loading")
        return self._set(replace(cell, role=cell.target, target=None, since_s=now_s))

    def mark_failed(self, cell_id: int, *, now_s: float) -> Cell:
        """A failed standalone cell hands its floor duty to an elastic cell of that role."""
        cell = self._cells[cell_id]
        failed = self._set(replace(cell, role=Role.FAILED, target=None, standalone=False,
                                   since_s=now_s))
        if cell.standalone:
            duty = cell.heading
            spare = [c for c in self.cells if not c.standalone and c.role is duty]
            if spare:
                self._set(replace(spare[0], standalone=True))
        return failed

    def _set(self, cell: Cell) -> Cell:
        self._cells[cell.cell_id] = cell
        self._ordered = None
        self.check_invariants()
        return cell

    def check_invariants(self) -> None:
        for c in self._cells.values():
            assert isinstance(c.role, Role), c
            in_transit = c.role in (Role.DRAINING, Role.LOADING)
            assert in_transit == (c.target is not None), f"cell {c.cell_id}: role/target {c}"
            assert not (c.standalone and in_transit), f"standalone cell {c.cell_id} is moving"
