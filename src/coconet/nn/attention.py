"""Self-attention and the MLP with their heads and hidden features split over the tp ranks.

``ParallelSelfAttention`` is Megatron's: the query, key and value projection is one
``ColumnParallelLinear`` whose weight rows are ordered by head (rank r holds the q, k and v rows
of its ``n_head / tp`` heads), the attention itself runs on the local heads with
``torch.nn.functional.scaled_dot_product_attention`` (no communication), and the output
projection is a ``RowParallelLinear`` taking those heads' features and all_reducing the result.
``ParallelMLP`` is ``ColumnParallelLinear`` -> gelu -> ``RowParallelLinear``. Both take their
weights from nanoGPT/GPT-2-style modules (``from_modules``) and give them back (``to_full``).

Dropout, as nanoGPT and GPT-2 apply it in training: ``attn_dropout`` on the attention
probabilities and ``resid_dropout`` after the output projection (the row-parallel layer's own
dropout), both with coconet's counter-based masks (``coconet.random``) keyed by the layer's
``seed``, its call count and the element's *global* index (the head's index among all
``n_head``): the same masks however the heads are split over the ranks, and on one process with
``coconet.random.dropout_mask``. In eval mode, or with ``attn_dropout=0``, the attention runs as
``scaled_dot_product_attention``'s fused kernel; with dropout it is written out (scores,
softmax, the mask, the product with the values), since that kernel draws its mask from torch's
generator, which differs between ranks unless they are seeded alike and stay in step.

Decoding: ``new_cache()`` gives a ``KVCache`` of this rank's heads; ``forward(x, cache=...)``
appends the new tokens' keys and values and attends over everything cached (causally within the
new tokens).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from coconet.errors import ConfigError
from coconet.ir.semantics import apply_dropout
from coconet.nn.layers import ColumnParallelLinear, LayerSchedule, RowParallelLinear, probability
from coconet.random import derive_seed
from coconet.runtime.comm import Communicator

__all__ = ["KVCache", "ParallelMLP", "ParallelSelfAttention"]


class KVCache:
    """One attention layer's keys and values of this rank's heads, ``[B, heads, T, head_dim]``,
    in buffers that grow by doubling (no copy of the whole cache per token)."""

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys and values; return every cached one (views of the buffers)."""
        new = k.shape[2]
        if self._k is None or self.length + new > self._k.shape[2]:
            cap = max(2 * (self.length + new), 16)
            shape = (*k.shape[:2], cap, k.shape[3])
            grown_k, grown_v = k.new_empty(shape), v.new_empty(shape)
            if self._k is not None:
                grown_k[:, :, : self.length] = self._k[:, :, : self.length]
                grown_v[:, :, : self.length] = self._v[:, :, : self.length]
            self._k, self._v = grown_k, grown_v
        self._k[:, :, self.length : self.length + new] = k
        self._v[:, :, self.length : self.length + new] = v
        self.length += new
        return self._k[:, :, : self.length], self._v[:, :, : self.length]


def _heads(n_head: Any, d_model: int, comm: Communicator, axis: str | None, who: str) -> int:
    parts = comm.mesh.axis_size(axis)
    if not isinstance(n_head, int) or isinstance(n_head, bool) or n_head < 1:
        raise ConfigError(f"n_head must be a positive int, got {n_head!r}", op=who,
                          hint="the model's number of attention heads")  # fmt: skip
    if d_model % n_head or n_head % parts:
        raise ConfigError(
            f"{n_head} heads of a {d_model}-wide model over {parts} ranks: the heads must "
            "divide the width and the ranks the heads",
            op=who,
            hint="each rank holds whole heads (Megatron's rule): choose tp dividing n_head",
        )
    return n_head // parts


class ParallelSelfAttention(nn.Module):
    """Causal (by default) multi-head self-attention, ``n_head / tp`` heads per rank.

    ``attn_dropout``: dropout of the attention probabilities in training; ``resid_dropout``:
    after the output projection (nanoGPT's and GPT-2's two dropouts). Their masks are
    coconet's counter-based ones (module docstring), each its own stream under ``seed``:
    ``attn_seed`` and ``proj.seed``, stepped by ``calls`` and ``proj.calls`` (one per training
    forward). Give two layers different seeds (``parallelize`` derives one per module name),
    else they draw the same masks.
    """

    def __init__(self, d_model: int, n_head: int, bias: bool = True, *, comm: Communicator,
                 axis: str | None = None, causal: bool = True, attn_dropout: float = 0.0,
                 resid_dropout: float = 0.0, seed: int = 0, fused_kernels: bool = False,
                 schedule: LayerSchedule = None, dtype: torch.dtype = torch.float32,
                 device: Any = None) -> None:  # fmt: skip
        super().__init__()
        who = "ParallelSelfAttention"
        self.local_heads = _heads(n_head, d_model, comm, axis, who)
        self.d_model, self.n_head, self.causal = d_model, n_head, bool(causal)
        self.head_dim = d_model // n_head
        self.attn_p = probability(attn_dropout, who, "attn_dropout")
        resid_p = probability(resid_dropout, who, "resid_dropout")
        self.seed = int(seed)
        self.attn_seed = derive_seed(self.seed, "attn_dropout")
        self.calls = 0  # the attention-probability mask's step: one per training forward
        kw = dict(comm=comm, axis=axis, fused_kernels=fused_kernels, schedule=schedule,
                  dtype=dtype, device=device)  # fmt: skip
        self.qkv = ColumnParallelLinear(d_model, 3 * d_model, bias, **kw)
        self.proj = RowParallelLinear(d_model, d_model, bias, dropout=resid_p,
                                      seed=derive_seed(self.seed, "resid_dropout"),
                                      **kw)  # fmt: skip
        # this rank's first head among all n_head: where its block of the probabilities starts
        self.first_head = self.qkv.index * self.local_heads

    # -- conversion: nanoGPT's c_attn rows are q | k | v; a rank's part is its heads' q, k, v --

    def _order(self) -> torch.Tensor:
        """Rows of c_attn in head order: rank after rank, each its q, k and v rows."""
        parts, d, width = self.n_head // self.local_heads, self.d_model, self.local_heads * \
            self.head_dim  # fmt: skip
        rows = [torch.arange(r * width, (r + 1) * width) + which * d
                for r in range(parts) for which in range(3)]  # fmt: skip
        return torch.cat(rows)

    @classmethod
    def from_modules(cls, c_attn: nn.Linear, c_proj: nn.Linear, n_head: int, *,
                     comm: Communicator, **kwargs: Any) -> ParallelSelfAttention:  # fmt: skip
        """This rank's heads of a nanoGPT/GPT-2 attention (``c_attn``: d -> 3d as q | k | v).

        ``kwargs`` go to the constructor: give the module's dropouts as ``attn_dropout`` and
        ``resid_dropout`` (``parallelize`` reads them off the module)."""
        for name, m in (("c_attn", c_attn), ("c_proj", c_proj)):
            if not isinstance(m, nn.Linear):
                raise ConfigError(f"{name} must be an nn.Linear, got {type(m).__name__}",
                                  op="ParallelSelfAttention.from_modules",
                                  hint="GPT-2/nanoGPT's c_attn and c_proj")  # fmt: skip
        d = c_proj.in_features
        if c_attn.in_features != d or c_attn.out_features != 3 * d or c_proj.out_features != d:
            raise ConfigError(
                f"c_attn is {c_attn.in_features} -> {c_attn.out_features} and c_proj "
                f"{c_proj.in_features} -> {c_proj.out_features}",
                op="ParallelSelfAttention.from_modules",
                hint="c_attn maps d to 3d (q | k | v), c_proj d to d",
            )
        layer = cls(d, n_head, c_attn.bias is not None, comm=comm, dtype=c_attn.weight.dtype,
                    device=c_attn.weight.device, **kwargs)  # fmt: skip
        order = layer._order()
        ordered = nn.Linear(d, 3 * d, bias=c_attn.bias is not None, dtype=c_attn.weight.dtype,
                            device=c_attn.weight.device)  # fmt: skip
        with torch.no_grad():
            ordered.weight.copy_(c_attn.weight[order])
            if c_attn.bias is not None:
                ordered.bias.copy_(c_attn.bias[order])
        layer.qkv._load_full(ordered)
        layer.proj._load_full(c_proj)
        return layer

    @torch.no_grad()
    def to_full(self) -> tuple[nn.Linear, nn.Linear]:
        """The whole ``(c_attn, c_proj)`` on every rank, c_attn's rows back in q | k | v order."""
        ordered = self.qkv.to_full()
        back = torch.empty_like(self._order())
        back[self._order()] = torch.arange(3 * self.d_model)
        ordered.weight.copy_(ordered.weight[back])
        if ordered.bias is not None:
            ordered.bias.copy_(ordered.bias[back])
        return ordered, self.proj.to_full()

    def new_cache(self) -> KVCache:
        return KVCache()

    def forward(self, x: torch.Tensor, cache: KVCache | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ConfigError(
                f"the input must be [batch, tokens, {self.d_model}], got "
                f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}",
                op="ParallelSelfAttention",
                hint="the whole hidden state on every rank of the group (as nanoGPT's "
                "CausalSelfAttention takes it)",
            )
        B, T, _ = x.shape
        h, dh = self.local_heads, self.head_dim
        q, k, v = self.qkv(x).split(h * dh, dim=2)
        q, k, v = (t.reshape(B, T, h, dh).transpose(1, 2) for t in (q, k, v))
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)
        if self.attn_p > 0.0 and self.training:
            y = self._attend_with_dropout(q, k, v, past)
        elif past == 0 or not self.causal:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal and T > 1)
        elif T == 1:  # one new token attends to everything cached: no mask to build or read
            y = F.scaled_dot_product_attention(q, k, v)
        else:  # new tokens attend to everything cached and causally among themselves
            keep = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        y = y.transpose(1, 2).reshape(B, T, h * dh)
        return self.proj(y, residual=residual)

    def _attend_with_dropout(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             past: int) -> torch.Tensor:  # fmt: skip
        """nanoGPT's attention written out, with coconet's mask on the probabilities: this
        rank's heads are the block ``[:, first_head : first_head + local_heads]`` of the
        ``[B, n_head, T, S]`` probabilities, so each element draws by its global index."""
        B, _, T, _ = q.shape
        S = k.shape[2]  # past + T keys
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        if self.causal:  # each new token sees everything cached and the new ones up to itself
            keep = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(past)
            scores = scores.masked_fill(~keep, float("-inf"))
        probs = F.softmax(scores, dim=-1)
        probs = apply_dropout(probs, self.attn_p, self.attn_seed, self.calls,
                              (B, self.n_head, T, S), (0, self.first_head, 0, 0))  # fmt: skip
        self.calls += 1
        return probs @ v

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, n_head={self.n_head}, local_heads={self.local_heads}, "
            f"causal={self.causal}, attn_dropout={self.attn_p}, resid_dropout={self.proj.p}"
        )


class ParallelMLP(nn.Module):
    """``c_proj(gelu(c_fc(x)))`` with the hidden features split over the ranks (dropout and a
    residual fused into the output projection's program)."""

    def __init__(self, d_model: int, d_hidden: int, bias: bool = True, *, comm: Communicator,
                 axis: str | None = None, dropout: float = 0.0, seed: int = 0,
                 fused_kernels: bool = False, schedule: LayerSchedule = None,
                 dtype: torch.dtype = torch.float32, device: Any = None) -> None:  # fmt: skip
        super().__init__()
        kw = dict(comm=comm, axis=axis, fused_kernels=fused_kernels, schedule=schedule,
                  dtype=dtype, device=device)  # fmt: skip
        self.fc = ColumnParallelLinear(d_model, d_hidden, bias, **kw)
        self.proj = RowParallelLinear(d_hidden, d_model, bias, dropout=dropout, seed=seed, **kw)

    @classmethod
    def from_modules(cls, c_fc: nn.Linear, c_proj: nn.Linear, *, comm: Communicator,
                     **kwargs: Any) -> ParallelMLP:  # fmt: skip
        layer = cls(c_fc.in_features, c_fc.out_features, c_fc.bias is not None, comm=comm,
                    dtype=c_fc.weight.dtype, device=c_fc.weight.device, **kwargs)  # fmt: skip
        layer.fc._load_full(c_fc)
        layer.proj._load_full(c_proj)
        return layer

    def to_full(self) -> tuple[nn.Linear, nn.Linear]:
        return self.fc.to_full(), self.proj.to_full()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)), residual=residual)
