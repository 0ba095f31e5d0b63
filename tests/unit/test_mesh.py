"""The device mesh: coordinates, ranks and groups along named axes."""

from __future__ import annotations

import pytest

from coconet import Mesh


def test_one_axis():
    m = Mesh(world=4)
    assert m == Mesh.world(4)
    assert m.size == 4
    assert m.names == ("world",)
    assert str(m) == "Mesh(world=4)"
    assert [m.coords(r) for r in range(4)] == [{"world": r} for r in range(4)]
    assert [m.rank_of({"world": r}) for r in range(4)] == [0, 1, 2, 3]
    assert m.group_of(2, "world") == [0, 1, 2, 3]
    assert m.group_of(2, None) == [0, 1, 2, 3]
    assert m.groups("world") == [[0, 1, 2, 3]]
    assert m.groups(None) == [[0, 1, 2, 3]]
    assert m.index_in(3, "world") == 3
    assert m.axis_size("world") == 4
    assert m.axis_size(None) == 4


def test_two_axes_row_major():
    m = Mesh(pp=2, tp=3)
    assert m.size == 6
    assert m.names == ("pp", "tp")
    assert str(m) == "Mesh(pp=2, tp=3)"
    assert m.coords(0) == {"pp": 0, "tp": 0}
    assert m.coords(2) == {"pp": 0, "tp": 2}
    assert m.coords(4) == {"pp": 1, "tp": 1}
    for r in range(6):
        assert m.rank_of(m.coords(r)) == r
    assert m.rank_of({"tp": 2, "pp": 1}) == 5  # order of the dict does not matter
    # tp groups: ranks that share a pipeline stage; pp groups: ranks that share a tp index
    assert m.groups("tp") == [[0, 1, 2], [3, 4, 5]]
    assert m.groups("pp") == [[0, 3], [1, 4], [2, 5]]
    assert m.group_of(4, "tp") == [3, 4, 5]
    assert m.group_of(4, "pp") == [1, 4]
    assert m.index_in(4, "tp") == 1
    assert m.index_in(4, "pp") == 1
    assert m.index_in(4, None) == 4
    assert m.axis_size("pp") == 2 and m.axis_size("tp") == 3


def test_three_axes_groups_partition_the_world():
    m = Mesh(dp=2, pp=2, tp=2)
    for axis in m.names:
        groups = m.groups(axis)
        assert len(groups) == 4
        assert sorted(r for g in groups for r in g) == list(range(8))
        for g in groups:
            # within a group only ``axis`` changes, and it runs 0..size-1 in order
            coords = [m.coords(r) for r in g]
            assert [c[axis] for c in coords] == [0, 1]
            others = [{k: v for k, v in c.items() if k != axis} for c in coords]
            assert others[0] == others[1]
    assert m.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_axes_from_a_dict_keep_their_order():
    m = Mesh({"tp": 2, "dp": 3})
    assert m.names == ("tp", "dp")
    assert m.groups("dp") == [[0, 1, 2], [3, 4, 5]]
    assert m == Mesh(tp=2, dp=3)
    assert m != Mesh(dp=3, tp=2)
    assert hash(m) == hash(Mesh(tp=2, dp=3))


def test_size_one_axis():
    m = Mesh(pp=1, tp=2)
    assert m.groups("pp") == [[0], [1]]
    assert m.groups("tp") == [[0, 1]]


@pytest.mark.parametrize(
    ("args", "kwargs", "fragment"),
    [
        ((), {}, "needs at least one axis"),
        ((), {"tp": 0}, "mesh axis 'tp' needs a positive int size, got 0"),
        ((), {"tp": -2}, "got -2"),
        ((), {"tp": 2.0}, "got 2.0"),
        ((), {"tp": True}, "got True"),
        (({"dp": "2"},), {}, "mesh axis 'dp'"),
    ],
)
def test_bad_sizes_raise(args, kwargs, fragment):
    with pytest.raises(ValueError) as info:
        Mesh(*args, **kwargs)
    assert fragment in str(info.value)


def test_bad_ranks_and_coords_raise():
    m = Mesh(pp=2, tp=2)
    with pytest.raises(ValueError, match=r"rank 4 is not in Mesh\(pp=2, tp=2\) \(ranks 0..3\)"):
        m.coords(4)
    with pytest.raises(ValueError, match="rank -1"):
        m.coords(-1)
    with pytest.raises(ValueError, match="coordinate tp=2 is outside"):
        m.rank_of({"pp": 0, "tp": 2})
    with pytest.raises(ValueError, match="one coordinate per axis"):
        m.rank_of({"pp": 0})
    with pytest.raises(KeyError, match="has no axis 'dp'"):
        m.axis_size("dp")
