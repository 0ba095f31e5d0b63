"""``fully_shard``: a model whose parameters are stored 1/world per rank, gathered per block.

What happens in a step (``FullyShardedModel``), block by block:

- **Forward.** Before a block's forward its segments are all-gathered into their whole buffers
  (``Block.finish_gather``) and the next block's gather is started (prefetch, where the
  transport progresses on its own); after it the whole buffers are freed
  (``reshard_after_forward=True``, the default; the root block, whose parameters the model's
  first and last layers share, stays gathered until its backward).
- **Backward.** When the gradient reaches a block's outputs, the block is gathered again and
  the previous block's gather is started. Once every trainable parameter of the block has
  its gradient, the gradients are copied into one flat buffer per segment (where the step's
  collective reads them in place) and each segment's **optimizer step runs: the fused
  reduce_scatter of the gradient and update of this rank's slice** (the paper's
  ``fuse(RS, update)``; the all_gather that would end it is the next forward's), and the block
  is freed. A block some of whose parameters got no gradient (or the root, whose tied
  embedding gets its gradient twice) steps at the end of the backward, in the reverse of the
  forward's order: the same order on every rank.

The step is the optimizer's: build a ``coconet.optim`` optimizer over ``model.parameters()``
after ``fully_shard`` (``coconet.optim.sharded`` is its side). ``optimizer.step()`` then has
nothing left to do (the update ran in the backward, as with ``ddp=``), and every backward is a
step; with ``update_in_backward=False`` (or ``max_grad_norm=``) the backward reduce_scatters
into a sum that ``optimizer.step()`` updates from: gradients accumulated over micro-batches.

Every rank must build the same model and call ``fully_shard`` with the same blocks.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from coconet.errors import ConfigError
from coconet.fsdp import dcp
from coconet.fsdp.blocks import Block, Unsharded
from coconet.options import TransportKind
from coconet.runtime import launch
from coconet.runtime.allocator import trim_heap
from coconet.runtime.comm import Communicator

__all__ = ["FullyShardedModel", "fully_shard", "sharded_model_of"]

# the attribute a fully sharded parameter carries: its block (how an optimizer finds it)
BLOCK_ATTR = "_coconet_fsdp_block"


def sharded_model_of(p: torch.Tensor) -> FullyShardedModel | None:
    """The ``FullyShardedModel`` whose block holds parameter ``p`` (None: not fully sharded)."""
    block = getattr(p, BLOCK_ATTR, None)
    return None if block is None else block.owner_model


def fully_shard(model: nn.Module, *, blocks: Iterable[nn.Module] | None = None,
                comm: Any = None, reshard_after_forward: bool = True,
                prefetch: bool | None = None, update_in_backward: bool = True,
                ) -> FullyShardedModel:  # fmt: skip
    """Shard ``model``'s parameters over ``comm``'s ranks (in place; see the module
    docstring), and return the handle of the sharded model.

    ``blocks``: the modules gathered one at a time (torchtitan's ``fully_shard(layer)`` for
    each transformer layer); default: every module of the model's ``nn.ModuleList``s. The
    parameters of no block form the root block, gathered for the whole forward and backward.
    ``comm``: default the communicator of ``coconet.runtime.init()``. ``prefetch``: start the
    next block's gather before this one computes (default: where the transport progresses on
    its own, torch.distributed; over shared memory a gather is one synchronous copy).
    ``update_in_backward=False``: the backward reduce_scatters each block's gradient and adds
    it to this rank's slice of the sum, and ``optimizer.step()`` updates: gradients
    accumulated over several backwards (micro-batches), at one more pass over the slices
    (also what ``max_grad_norm=`` does, whose norm needs every block's gradient first)."""
    if comm is None:
        comm = launch.current() or launch.init()
    elif not isinstance(comm, Communicator):
        raise ConfigError(
            f"fully_shard needs a communicator, got comm={comm!r}",
            op="coconet.fsdp.fully_shard",
            hint="comm = coconet.runtime.init(); coconet.fsdp.fully_shard(model, comm=comm), "
            "or leave comm out for that default",
        )
    return FullyShardedModel(model, blocks, comm, reshard_after_forward, prefetch,
                             update_in_backward)  # fmt: skip


class FullyShardedModel:
    """A model fully sharded by ``fully_shard`` (see the module docstring): its blocks, the
    hooks that gather and free them and hand their gradients to the optimizer."""

    def __init__(self, model: nn.Module, blocks: Iterable[nn.Module] | None, comm: Any,
                 reshard_after_forward: bool, prefetch: bool | None,
                 update_in_backward: bool = True) -> None:  # fmt: skip
        if any(getattr(p, BLOCK_ATTR, None) is not None for p in model.parameters()):
            raise ConfigError(
                "this model's parameters are fully sharded already",
                op="coconet.fsdp.fully_shard",
                hint="call fully_shard once per model, with every block in blocks=",
            )
        self.module, self.comm = model, comm
        self.reshard_after_forward = reshard_after_forward
        self.update_in_backward = update_in_backward
        async_transport = comm.world > 1 and comm.transport_of(None) is not (
            TransportKind.SHARED_MEMORY)
        self.prefetch = async_transport if prefetch is None else bool(prefetch)
        chosen = _default_blocks(model) if blocks is None else list(blocks)
        names = {id(m): n for n, m in model.named_modules()}
        for m in chosen:
            if id(m) not in names or m is model:
                raise ConfigError(
                    f"blocks= holds a {type(m).__name__} that is not a submodule of the model",
                    op="coconet.fsdp.fully_shard",
                    hint="pass the model's own layers (model.layers, model.transformer.h)",
                )
        param_names = {id(p): n for n, p in model.named_parameters()}
        taken: set[int] = set()
        self.blocks: list[Block] = []
        for m in chosen:
            mine = [p for p in m.parameters() if id(p) not in taken]
            if not mine:
                continue
            taken.update(id(p) for p in mine)
            self.blocks.append(Block(len(self.blocks), names[id(m)], m, mine,
                                     [param_names[id(p)] for p in mine], comm))  # fmt: skip
        rest = [p for p in model.parameters() if id(p) not in taken]
        self.root: Block | None = None
        if rest:
            self.root = Block(len(self.blocks), "root", model,
                              rest, [param_names[id(p)] for p in rest], comm, root=True)
            self.blocks.append(self.root)
        _agree_on_blocks(comm, self.blocks)
        for b in self.blocks:
            b.owner_model = self
            for p in b.params:
                setattr(p, BLOCK_ATTR, b)
        self.order: list[Block] = []  # the blocks in the order the first forward ran them
        self._queued = False  # the end-of-backward callback is queued
        self._held = False  # inside gathered(): the hooks free nothing
        self.handles = [model.register_forward_pre_hook(self._start_forward)]
        for b in self.blocks:
            if not b.root:
                self.handles.append(b.module.register_forward_pre_hook(self._pre_forward(b)))
                self.handles.append(b.module.register_forward_hook(self._post_forward(b)))
            for i, p in enumerate(b.params):
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(
                        self._grad_arrived(b, i)))  # fmt: skip
        if self.root is not None:
            self.handles.append(model.register_forward_hook(self._post_forward(self.root)))
        for b in self.blocks:
            b.free()
        trim_heap()  # the model's whole parameters, freed: back to the system

    # -- what users call -------------------------------------------------------------------------

    @contextlib.contextmanager
    def gathered(self, writeback: bool = False) -> Iterator[None]:
        """Every block gathered while inside (collective): read the whole parameters, or, with
        ``writeback=True``, write them in place (the same values on every rank: an
        initialisation, a ``load_state_dict``), and each rank keeps its slices of what was
        written (the optimizer's float32 master copies of 16-bit parameters start again from
        it). A forward (and backward) run inside keeps every block gathered."""
        for b in self.blocks:
            b.finish_gather()
        self._held = True
        try:
            yield
            if writeback:
                for b in self.blocks:
                    b.take_slices()
                    for seg in b.segments:
                        if seg.owner is not None:
                            seg.owner.took_values(seg)
        finally:
            self._held = False
            for b in self.blocks:
                b.free()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's ``state_dict()`` with whole parameters (collective: every rank gets the
        whole copy), loadable into the model unsharded on one process."""
        with self.gathered():
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """``module.load_state_dict`` of whole parameters (a ``state_dict()`` of this model at
        any world size, or of the model unsharded); each rank keeps its slices. Collective."""
        with self.gathered(writeback=True):
            return self.module.load_state_dict(state_dict, strict=strict)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's slices as torch's distributed checkpoint takes them (no communication):
        each parameter, by its name, a flat ``ShardedTensor`` whose local part is a view of
        this rank's slice (``coconet.fsdp.dcp``); the buffers as they are. Save it with
        ``torch.distributed.checkpoint.save``; to load, ``dcp.load`` into this model's
        ``sharded_state_dict()`` (at any world size: it writes the slices in place) and pass
        the result to ``load_sharded_state_dict``."""
        dcp.whole_world(self.comm, "sharded_state_dict")
        rank = dist.get_rank()
        out: dict[str, Any] = {}
        for b in self.blocks:
            for i, seg, offset, at in dcp.flat_parts(b):
                numel = seg.numels[seg.members.index(i)]
                local = None if at < 0 else seg.shard[at : at + _part(seg, i, offset, numel)]
                out[b.names[i]] = dcp.sharded(local, offset, numel, rank)
        for name, buf in self.module.named_buffers():
            out[name] = buf
        return out

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take what ``dcp.load`` wrote into a ``sharded_state_dict()`` of this model: the
        slices (written in place already, copied otherwise) and the buffers; the optimizer's
        float32 master copies of 16-bit parameters start again from them."""
        for b in self.blocks:
            for i, seg, _, at in dcp.flat_parts(b):
                if b.names[i] not in state_dict:
                    raise ConfigError(
                        f"the sharded state dict has no {b.names[i]!r}",
                        op="coconet.fsdp.load_sharded_state_dict",
                        hint="dcp.load into this model's sharded_state_dict(), then pass it",
                    )
                local = dcp.local_of(state_dict[b.names[i]])
                if at >= 0 and local is not None:
                    here = seg.shard[at : at + local.numel()]
                    if here.data_ptr() != local.data_ptr():
                        with torch.no_grad():
                            here.copy_(local)
            for seg in b.segments:
                if seg.owner is not None:
                    seg.owner.took_values(seg)
        with torch.no_grad():
            for name, buf in self.module.named_buffers():
                if name in state_dict and state_dict[name] is not buf:
                    buf.copy_(state_dict[name])

    def memory(self) -> dict[str, int]:
        """Bytes this rank stores for good (``slices``) and the whole blocks' (``whole``)."""
        return {"slices": sum(b.stored_bytes() for b in self.blocks),
                "whole": sum(b.whole_bytes() for b in self.blocks)}  # fmt: skip

    def remove(self) -> None:
        """Gather the parameters back whole on every rank and remove the hooks (collective)."""
        for b in self.blocks:
            b.finish_gather()
        for h in self.handles:
            h.remove()
        for b in self.blocks:
            for p in b.params:
                with torch.no_grad():
                    p.data = p.data.clone()
                delattr(p, BLOCK_ATTR)

    # -- the hooks -------------------------------------------------------------------------------

    def _release(self, b: Block) -> None:
        """Free ``b`` after its use, unless ``gathered()`` holds every block whole."""
        if not self._held:
            b.free()

    def _start_forward(self, module: nn.Module, args: Any) -> None:
        """A forward of the whole model begins: what a backward that failed half-way left
        (blocks gathered, gradients lent) is put away, and the root gathered."""
        for b in self.blocks:
            if b.prepared and not b.reduced:
                for seg in b.segments:
                    _lend_back(b, seg)
            b.arrived, b.prepared, b.reduced = set(), False, False
            if not b.root and b.state is not Unsharded.FREED:
                self._release(b)
        self._queued = False
        if self.root is not None:
            self._note_order(self.root)
            self.root.finish_gather()

    def _note_order(self, b: Block) -> None:
        if b not in self.order:
            self.order.append(b)

    def _neighbour(self, b: Block, step: int) -> Block | None:
        if b not in self.order:
            return None
        k = self.order.index(b) + step
        return self.order[k] if 0 <= k < len(self.order) else None

    def _pre_forward(self, b: Block) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            self._note_order(b)
            b.finish_gather()
            if self.prefetch:
                nxt = self._neighbour(b, 1)
                if nxt is not None and not nxt.root:
                    nxt.start_gather()

        return _outside_graphs(hook)

    def _post_forward(self, b: Block) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            tensors = [t for t in _tensors(output) if t.requires_grad]
            if not tensors or not torch.is_grad_enabled():
                if not b.root or not torch.is_grad_enabled():
                    self._release(b)  # no backward will come through it
                return
            nxt = self._neighbour(b, 1)
            last = b in self.order and (nxt is None or nxt.root)
            # (the last block's backward comes first: it stays gathered, as torchtitan's)
            if self.reshard_after_forward and not b.root and not last:
                self._release(b)
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grads: self._pre_backward(b), mode="any")

        return _outside_graphs(hook)

    def _pre_backward(self, b: Block) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if b.prepared:
            return
        b.finish_gather()
        for seg in b.segments:
            trainable = [b.params[i] for i in seg.members if b.params[i].requires_grad]
            if not trainable:
                continue
            if seg.owner is None:
                i = next(i for i in seg.members if b.params[i].requires_grad)
                raise ConfigError(
                    f"parameter {b.names[i]!r} (block {b.name}) is fully sharded and trainable, "
                    "and no coconet.optim optimizer steps it: its gradient has nowhere to go",
                    op="coconet.fsdp backward",
                    hint="build the optimizer over model.parameters() after fully_shard, before "
                    "the first backward (or set requires_grad=False on what you freeze)",
                )
            # the buffer the step reads; autograd's own gradients are copied into it when the
            # block is complete (one pass; a zeroed buffer accumulated into would be three)
            seg.grad = seg.owner.gradient_buffer(seg)
            for i in seg.members:
                b.params[i].grad = None
        b.prepared = True
        if self.prefetch:
            prev = self._neighbour(b, -1)
            if prev is not None and not prev.root:
                prev.start_gather()

    def _grad_arrived(self, b: Block, i: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            if b.reduced:
                raise ConfigError(
                    f"parameter {b.names[i]!r} (block {b.name}) got a second gradient after its "
                    "block was stepped in this backward: it is used outside its block",
                    op="coconet.fsdp backward",
                    hint="put modules that share a parameter in one block (blocks=), or leave "
                    "them to the root block",
                )
            b.arrived.add(i)
            if not b.root and len(b.arrived) == sum(p.requires_grad for p in b.params):
                self._reduce(b)

        return hook

    def _reduce(self, b: Block) -> None:
        """Each segment's fused reduce_scatter and update, then the block freed."""
        with torch.no_grad():
            for seg in b.segments:
                if seg.grad is None:
                    continue
                try:
                    for j, i in enumerate(seg.members):
                        a, z = seg.span(j)
                        grad = b.params[i].grad
                        if grad is None:  # (no gradient reached it: zero, as DDP counts it)
                            seg.grad[a:z].zero_()
                        else:
                            seg.grad[a:z].copy_(grad.reshape(-1))
                        b.params[i].grad = None
                    seg.owner.step(seg)
                finally:
                    _lend_back(b, seg)
        b.reduced = True
        self._release(b)

    def _end_backward(self) -> None:
        """The end of a backward: the blocks whose step has not run yet (a parameter without a
        gradient, the root), in the reverse of the forward's order."""
        try:
            for b in reversed(self.order):
                if b.prepared and not b.reduced:
                    self._reduce(b)
                elif b.root and not b.prepared:
                    self._release(b)
        finally:
            for b in self.blocks:
                b.arrived, b.prepared, b.reduced = set(), False, False
            self._queued = False


def _agree_on_blocks(comm: Any, blocks: list[Block]) -> None:
    """Every rank shards the same blocks of the same shapes and dtypes, else all fail."""
    text = ";".join(f"{b.name}:" + ",".join(f"{p.dtype}{tuple(p.shape)}" for p in b.params)
                    for b in blocks)  # fmt: skip
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")
    low, high = comm.agree_max([digest, -digest], "coconet.fsdp blocks")
    if low != digest or -high != digest:
        raise ConfigError(
            f"the ranks shard different models ({len(blocks)} blocks here, the first "
            f"{blocks[0].name if blocks else 'none'})",
            op="coconet.fsdp.fully_shard",
            hint="build the same model on every rank and pass the same blocks=",
        )


def _outside_graphs(hook: Any) -> Any:
    """A module hook that ``torch.compile`` leaves out of the graphs it captures (a block
    compiled with ``block.compile()``): gathers and frees are communication and storage
    changes, a graph break at each of them rather than an attempt to trace them."""
    return torch.compiler.disable(hook)


def _part(seg: Any, i: int, offset: int, numel: int) -> int:
    """The length of parameter ``i``'s part on this rank (from ``offset`` in the parameter)."""
    s = seg.members.index(i)
    a, _ = seg.span(s)
    lo, hi = seg.bounds
    return min(a + numel, hi) - (a + offset)


def _lend_back(b: Block, seg: Any) -> None:
    """The segment's parameters without their gradient views (the step consumed them)."""
    for i in seg.members:
        b.params[i].grad = None
    seg.grad = None


def _tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, Sequence) and not isinstance(output, str):
        return [t for o in output for t in _tensors(o)]
    return []


def _default_blocks(model: nn.Module) -> list[nn.Module]:
    """Every module of the model's ``nn.ModuleList``s (a transformer's layers), outermost
    lists only."""
    found: list[nn.Module] = []
    seen: set[int] = set()
    for _, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and id(m) not in seen:
            for child in m:
                found.append(child)
                seen.update(id(x) for x in child.modules())
    return found
