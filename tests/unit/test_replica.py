"""``HostReplica`` and the commit of a gather published into one, without processes (the
memory is an ordinary tensor standing in for the owner's segment; test_dist_replica.py runs it
on ranks)."""

from __future__ import annotations

import torch

from coconet.runtime.replica import HostReplica, replica_bytes
from coconet.runtime.transport import Published


class _Segment:
    """What HostReplica reads of a SymmetricMemory: one rank's data area."""

    def __init__(self, nbytes: int) -> None:
        self.data = torch.zeros(nbytes, dtype=torch.uint8)
        self.closed = False

    def buffer(self, peer, dtype, numel, offset=0):
        size = torch.empty((), dtype=dtype).element_size()
        return self.data[offset : offset + numel * size].view(dtype)

    def close(self):
        self.closed = True


def _replica(n: int = 1000) -> HostReplica:
    return HostReplica(_Segment(replica_bytes((n,), torch.float32)), (n,), torch.float32)


def test_two_buffers_that_do_not_overlap_nor_alias_by_page():
    r = _replica()
    a, b = r.buffers()
    assert b - a >= 1000 * 4
    assert (b - a) % 4096 == 2048  # half a page off: no 4K aliasing between the two streams
    live, spare = r.live(), r.spare()
    live.fill_(1.0)
    spare.fill_(2.0)
    assert bool((r.live() == 1.0).all()) and bool((r.spare() == 2.0).all())


def test_holds_only_the_whole_live_buffer():
    r = _replica()
    assert r.holds(r.live())
    assert not r.holds(r.spare())
    assert not r.holds(r.live()[1:])
    assert not r.holds(r.live()[:10])
    assert not r.holds(torch.empty(1000))
    before = r.live()
    r.flip()
    assert r.holds(r.live()) and not r.holds(before)


def test_the_commit_flips_once_and_points_the_target_at_the_new_live_buffer():
    r = _replica(8)
    r.live().copy_(torch.arange(8.0))
    target = r.live()
    r.spare().copy_(torch.arange(8.0) + 100)  # what the ranks wrote
    released = []
    pub = Published([r.spare()[:4], r.spare()[4:]], lambda: released.append(1), (8,),
                    torch.float32, replica=r)
    with torch.no_grad():
        pub.copy_into(target)
        assert torch.equal(target, torch.arange(8.0) + 100)
        assert r.holds(target)
        pub.copy_into(target)  # the commit writes again after an interruption: no second flip
    assert torch.equal(target, torch.arange(8.0) + 100) and r.holds(target)
    assert released == [1]


def test_a_target_that_is_not_the_live_buffer_gets_a_copy():
    r = _replica(8)
    r.spare().copy_(torch.arange(8.0))
    other = torch.zeros(8)
    Published([r.spare()[:4], r.spare()[4:]], None, (8,), torch.float32,
              replica=r).copy_into(other)
    assert torch.equal(other, torch.arange(8.0))
    assert r.holds(r.live()) and not r.holds(other)  # nothing flipped
