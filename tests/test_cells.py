import pytest

from gyre_slurm.sched.cells import Cell, CellTable, CellTableError, Role, split_cells

NODES = [f"node{i}" for i in range(1, 9)]


def table(**kw):
    args = dict(cell_nodes=2, min_rollout_cells=1, min_train_cells=1)
    args.update(kw)
    return CellTable.build(NODES, **args)


def test_cells_are_consecutive_nodes_in_order():
    assert split_cells(NODES, 4) == [tuple(NODES[:4]), tuple(NODES[4:])]
    with pytest.raises(ValueError, match="cannot be split into cells of 3"):
        split_cells(NODES, 3)


def test_floors_and_elastic_pool():
    t = table()
    assert [c.role for c in t.cells] == [Role.ROLLOUT, Role.TRAIN, Role.ROLLOUT, Role.ROLLOUT]
    assert [c.standalone for c in t.cells] == [True, True, False, False]
    with pytest.raises(ValueError, match="floors need 5 cells"):
        table(min_rollout_cells=3, min_train_cells=2)


@pytest.mark.parametrize("steps, final_role", [
    ([("begin", Role.TRAIN), ("load",), ("finish",)], Role.TRAIN),
    ([("begin", Role.TRAIN), ("cancel",)], Role.ROLLOUT),
    ([("begin", Role.TRAIN), ("load",), ("finish",), ("begin", Role.ROLLOUT), ("load",),
      ("finish",)], Role.ROLLOUT),
])
def test_legal_handoffs(steps, final_role):
    t = table()
    for i, step in enumerate(steps):
        if step[0] == "begin":
            t.begin_handoff(2, step[1], now_s=i)
            assert t[2].role is Role.DRAINING and t[2].target is step[1]
        elif step[0] == "load":
            t.begin_loading(2, now_s=i)
            assert t[2].role is Role.LOADING
        elif step[0] == "cancel":
            t.cancel_drain(2, now_s=i)
        else:
            t.finish_handoff(2, now_s=i)
    assert t[2].role is final_role and t[2].target is None


@pytest.mark.parametrize("action, match", [
    (lambda t: t.begin_handoff(0, Role.TRAIN, now_s=0), "standalone"),
    (lambda t: t.begin_handoff(1, Role.ROLLOUT, now_s=0), "standalone"),
    (lambda t: t.begin_handoff(2, Role.ROLLOUT, now_s=0), "cannot start a handoff"),
    (lambda t: t.begin_handoff(2, Role.LOADING, now_s=0), "cannot hand off"),
    (lambda t: t.begin_loading(2, now_s=0), "not draining"),
    (lambda t: t.finish_handoff(2, now_s=0), "not loading"),
    (lambda t: t.cancel_drain(3, now_s=0), "not draining"),
])
def test_illegal_transitions_are_refused(action, match):
    t = table()
    before = t.cells
    with pytest.raises(CellTableError, match=match):
        action(t)
    assert t.cells == before


def test_failed_standalone_cell_hands_its_floor_to_an_elastic_cell():
    t = table()
    t.mark_failed(0, now_s=5)
    assert t[0].role is Role.FAILED
    assert sum(1 for c in t.cells if c.standalone and c.role is Role.ROLLOUT) == 1


def test_a_cell_has_exactly_one_role():
    with pytest.raises(AssertionError):
        CellTable([Cell(0, ("n1",), False, Role.DRAINING, target=None)])
    with pytest.raises(AssertionError):
        CellTable([Cell(0, ("n1",), True, Role.LOADING, target=Role.TRAIN)])
