"""The hierarchical transport's layouts, plans and stated order (``coconet.runtime.hierarchy``),
and which groups routing runs over hosts and how; no processes (tests/dist/test_hosts.py runs
both plans on namespace hosts)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coconet.ir.ops import ReduceOp
from coconet.ir.semantics import reduce_values
from coconet.ir.types import slice_bounds
from coconet.runtime.hierarchy import CrossHost, HostLayout, _place, _rows, reduce_order
from coconet.runtime.routing import levels_plan

hosts_of_members = st.lists(st.sampled_from("abcd"), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(hosts_of_members)
def test_a_layout_numbers_hosts_and_local_places_in_group_order(idents):
    layout = HostLayout.of(idents)
    seen: list[str] = []
    for p, ident in enumerate(idents):
        if ident not in seen:
            seen.append(ident)
        assert layout.host_of[p] == seen.index(ident)
        assert layout.local_of[p] == idents[:p].count(ident)
        assert layout.position(layout.host_of[p], layout.local_of[p]) == p
    counts = [idents.count(h) for h in seen]
    assert layout.homogeneous == (len(set(counts)) == 1)
    # each host's members, in group order, partition the group (any layout)
    by_host = [layout.members(h) for h in range(layout.hosts)]
    assert sorted(p for m in by_host for p in m) == list(range(len(idents)))
    assert all(m == sorted(m) and len(m) == c for m, c in zip(by_host, counts, strict=True))
    if layout.homogeneous:  # each position is on one host and has one local index
        by_local = sorted(p for lo in range(layout.per_host) for p in layout.counterparts(lo))
        assert by_local == list(range(len(idents)))


@settings(max_examples=200, deadline=None)
@given(hosts_of_members)
def test_each_hosts_leader_is_its_first_member_and_the_plan_follows_the_counts(idents):
    layout = HostLayout.of(idents)
    leaders = layout.leaders
    # one per host, in host order: the first position of each host, local index 0
    assert leaders == [idents.index(h) for h in dict.fromkeys(idents)]
    assert leaders == sorted(leaders) and leaders[0] == 0
    assert all(layout.local_of[p] == 0 for p in leaders)
    assert [layout.members(h)[0] for h in range(layout.hosts)] == leaders
    counts = {idents.count(h) for h in idents}
    if len(set(idents)) == 1:
        assert layout.plan is None  # one host: nothing crosses
    elif len(counts) == 1:
        assert layout.plan is CrossHost.BY_LOCAL_INDEX
    else:
        assert layout.plan is CrossHost.THROUGH_LEADERS


@settings(max_examples=150, deadline=None)
@given(hosts_of_members, st.integers(0, 2**16), st.sampled_from([torch.float32, torch.bfloat16]))
def test_the_stated_order_is_over_hosts_in_host_order_of_each_hosts_sum_in_local_order(
    idents, seed, dtype
):
    """On any layout (homogeneous or not: both plans compute it), with 16-bit floats rounded
    once per level."""
    layout = HostLayout.of(idents)
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(5, generator=g).to(dtype) for _ in idents]
    per_host = []
    for h in range(layout.hosts):
        acc = None
        for p in (q for q, ident in enumerate(layout.host_of) if ident == h):
            acc = values[p].float() if acc is None else acc + values[p].float()
        per_host.append(acc.to(dtype))
    total = per_host[0].float()
    for s in per_host[1:]:
        total = total + s.float()
    assert torch.equal(reduce_order(ReduceOp.SUM, values, layout), total.to(dtype))
    # integers: any order is exact, so it is the rank-ordered sum; max is order-free
    ints = [v.float().round() for v in values]
    assert torch.equal(reduce_order(ReduceOp.SUM, ints, layout), reduce_values(ReduceOp.SUM, ints))
    assert torch.equal(reduce_order(ReduceOp.MAX, values, layout),
                       reduce_values(ReduceOp.MAX, values))  # fmt: skip


def test_the_stated_order_is_rank_order_only_where_each_host_holds_a_run_of_ranks_from_the_first():
    """3 members over 2 hosts: a, a, b adds ((x0 + x1) + x2), the simulator's order; a, b, b
    adds x0 + (x1 + x2), which is not (never claimed bitwise)."""
    x = [torch.tensor([1e-8]), torch.tensor([1.0]), torch.tensor([-1.0])]  # 1e-8 + 1 is 1
    rank_order = reduce_values(ReduceOp.SUM, x)
    assert torch.equal(reduce_order(ReduceOp.SUM, x, HostLayout.of("aab")), rank_order)
    assert not torch.equal(reduce_order(ReduceOp.SUM, x, HostLayout.of("abb")), rank_order)


@settings(max_examples=150, deadline=None)
@given(hosts_of_members, st.integers(0, 40))
def test_each_hosts_blocks_side_by_side_in_host_order_put_back_in_place_are_the_whole(
    idents, rows
):
    """What the leaders move: the flat split's blocks of each host's members, side by side
    (``_rows``; a reduce_scatter's sends), and every host's in host order put back in group
    order (``_place``; an all_gather's whole)."""
    layout = HostLayout.of(idents)
    whole = torch.arange(rows * 2, dtype=torch.float32).view(rows, 2)
    blocks = [slice_bounds(rows, len(idents), p) for p in range(len(idents))]
    owned = [[blocks[p] for p in layout.members(h)] for h in range(layout.hosts)]
    side = torch.cat([_rows(whole, r) for r in owned])
    assert torch.equal(_place(side, [rng for r in owned for rng in r]), whole)
    for h, r in enumerate(owned):  # each member's block sits at its local offset
        at = 0
        for p, (a, b) in zip(layout.members(h), r, strict=True):
            assert torch.equal(_rows(whole, r)[at : at + b - a],
                               torch.tensor_split(whole, len(idents))[p])  # fmt: skip
            at += b - a


def test_routing_takes_two_levels_on_homogeneous_hosts_leaders_elsewhere_and_ranks_in_order():
    by_index, leaders = CrossHost.BY_LOCAL_INDEX, CrossHost.THROUGH_LEADERS
    assert levels_plan((0, 1, 2, 3), HostLayout.of("aabb")) is by_index
    assert levels_plan((0, 1, 2, 3), HostLayout.of("abab")) is by_index  # interleaved: fine
    assert levels_plan((0, 1), HostLayout.of("ab")) is by_index  # one per host: exchange alone
    # not homogeneous: through one leader per host, whichever host holds more
    assert levels_plan((0, 1, 2), HostLayout.of("aab")) is leaders
    assert levels_plan((0, 1, 2), HostLayout.of("abb")) is leaders
    assert levels_plan((0, 1, 2), HostLayout.of("aba")) is leaders
    assert levels_plan((0, 1, 2, 3, 4), HostLayout.of("abccc")) is leaders
    # homogeneous, but b's 1st member comes after a's 2nd (local index 1: ranks 3, 2): leaders
    assert levels_plan((0, 1, 2, 3), HostLayout.of("abba")) is leaders
    # a host's members out of rank order (its process group would number them otherwise): flat
    assert levels_plan((2, 0, 1), HostLayout.of("aab")) is None
    assert levels_plan((1, 0, 2, 3), HostLayout.of("aabb")) is None
    assert levels_plan((0, 1, 2, 3), HostLayout.of("aaaa")) is None  # one host: shared memory
