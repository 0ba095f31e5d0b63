"""The two-level transport's layout and stated order (``coconet.runtime.hierarchy``), and which
groups routing runs in two levels; no processes (tests/dist/test_hosts.py runs it on hosts)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coconet.ir.ops import ReduceOp
from coconet.ir.semantics import reduce_values
from coconet.runtime.hierarchy import HostLayout, reduce_order
from coconet.runtime.routing import _two_levels

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
    assert layout.worthwhile == (len(seen) >= 2 and len(set(counts)) == 1)
    if layout.homogeneous:  # each position is on one host and has one local index
        by_host = sorted(p for h in range(layout.hosts) for p in layout.members(h))
        by_local = sorted(p for lo in range(layout.per_host) for p in layout.counterparts(lo))
        assert by_host == by_local == list(range(len(idents)))


@settings(max_examples=100, deadline=None)
@given(hosts_of_members.filter(lambda i: HostLayout.of(i).homogeneous), st.integers(0, 2**16))
def test_the_stated_order_is_over_hosts_of_each_hosts_sum(idents, seed):
    layout = HostLayout.of(idents)
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(5, generator=g) for _ in idents]
    want = reduce_values(
        ReduceOp.SUM,
        [reduce_values(ReduceOp.SUM, [values[p] for p in layout.members(h)])
         for h in range(layout.hosts)],  # fmt: skip
    )
    assert torch.equal(reduce_order(ReduceOp.SUM, values, layout), want)
    # integers: any order is exact, so it is the rank-ordered sum; max is order-free
    ints = [v.round() for v in values]
    assert torch.equal(reduce_order(ReduceOp.SUM, ints, layout), reduce_values(ReduceOp.SUM, ints))
    assert torch.equal(reduce_order(ReduceOp.MAX, values, layout),
                       reduce_values(ReduceOp.MAX, values))  # fmt: skip


def test_routing_runs_two_levels_only_where_they_pay_and_ranks_come_in_order():
    two_by_two = HostLayout.of("aabb")
    assert _two_levels((0, 1, 2, 3), two_by_two)
    assert _two_levels((0, 1, 2, 3), HostLayout.of("abab"))  # hosts interleaved: fine
    assert not _two_levels((0, 1, 2, 3), HostLayout.of("abba"))  # b's 1st member after a's 2nd
    assert _two_levels((0, 1), HostLayout.of("ab"))  # one rank per host: the exchange alone
    assert not _two_levels((0, 1, 2), HostLayout.of("aab"))  # not homogeneous: flat
    assert not _two_levels((0, 1, 2, 3), HostLayout.of("aaaa"))  # one host: shared memory
