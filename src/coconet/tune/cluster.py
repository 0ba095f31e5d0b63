"""Machine models from a written cluster description, for world sizes no one here can run.

A description is a small JSON file (two ship with coconet, by name: ``dgx-a100-ib`` and
``cpu-2core``; see ``coconet/tune/clusters/``)::

    {"name": "...", "ranks_per_node": 8, "device": "cuda",
     "intra_node": {"bandwidth_GBps": 230, "latency_us": 4},
     "inter_node": {"bandwidth_GBps": 23, "latency_us": 6},
     "memory_bandwidth_GBps": 1400, "peak_tflops": 19.5,
     "kernel_launch_us": 6, "step_overhead_us": 30, "overlap": 1.0}

Bandwidths are per rank (a GPU's NVLink bus bandwidth; its share of the node's network: a node
of G ranks has G B_inter). Over nodes of G ranks (N nodes of a group of W), by transport:

- **two levels** (``hierarchical``; and a group inside one node): a reduce_scatter inside each
  node, an all_reduce of the node's 1/G across nodes, an all_gather inside the node (as
  ``coconet.runtime.hierarchy`` runs it):

      t = 2 (G-1)/G S / B_intra + 2 (G-1) a_intra + 2 (N-1)/N (S/G) / B_inter + 2 (N-1) a_inter

- **flat** (``torch.distributed`` over nodes): rings over all W ranks, each pass moving
  (W-1)/W of the tensor through every edge, the slowest bounding it: inside a node at B_intra,
  across through the node's network (G B_inter: NCCL's rings, one per NIC, or one flow on a
  host's one NIC, as gloo):

      t = 2 (W-1)/W S max(1 / B_intra, 1 / (G B_inter)) + 2 (W-1) max(a_intra, a_inter)

  so across nodes a flat ring moves (W-1)/W of the tensor through a node's network where two
  levels move (N-1)/N (1.5x more at 2 nodes x 2 ranks).

``device`` (``"cuda"`` when absent): two levels run over shared memory, so ``coconet plan``
predicts them for ``"cpu"`` hosts only. A reduce_scatter or an all_gather is half of an
all_reduce; a reducing collective also reads
what it reduces once (S / memory bandwidth: the gamma term). A send crosses to the next stage
once. There is no shared memory across nodes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from coconet.errors import ConfigError
from coconet.ir.ops import Op
from coconet.ir.opspec import Traffic, spec
from coconet.options import TransportKind
from coconet.tune.cost import Curve, MachineModel

__all__ = ["SHIPPED", "cluster_model", "load_description"]

SHIPPED = ("dgx-a100-ib", "cpu-2core")
_REQUIRED = {
    "ranks_per_node": int,
    "intra_node": dict,
    "inter_node": dict,
    "memory_bandwidth_GBps": (int, float),
    "peak_tflops": (int, float),
}


def load_description(where: str | Path) -> dict[str, Any]:
    """A cluster description: a shipped one by name, or a JSON file."""
    text: str
    if str(where) in SHIPPED:
        text = resources.files("coconet.tune").joinpath(f"clusters/{where}.json").read_text()
        source = f"coconet's {where}"
    else:
        try:
            text = Path(where).read_text()
        except OSError as e:
            raise ConfigError(
                f"cannot read the cluster description {str(where)!r}: {e.strerror}",
                op="cluster description",
                hint=f"a JSON file, or one of coconet's: {', '.join(SHIPPED)}",
            ) from None
        source = str(where)
    try:
        d = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{source} is not JSON: {e}", op="cluster description",
                          hint="see coconet/tune/cluster.py for the format") from None
    for key, kind in _REQUIRED.items():
        if not isinstance(d.get(key), kind) or isinstance(d.get(key), bool):
            raise ConfigError(
                f"{source}: {key!r} is missing or not a {getattr(kind, '__name__', 'number')}",
                op="cluster description",
                hint='e.g. {"ranks_per_node": 8, "intra_node": {"bandwidth_GBps": 230, '
                '"latency_us": 4}, "inter_node": {...}, "memory_bandwidth_GBps": 1400, '
                '"peak_tflops": 19.5}',
            )
    for link in ("intra_node", "inter_node"):
        bw = d[link].get("bandwidth_GBps")
        if not isinstance(bw, (int, float)) or bw <= 0:
            raise ConfigError(f"{source}: {link}.bandwidth_GBps must be a positive number",
                              op="cluster description", hint='"bandwidth_GBps": 230')
    d.setdefault("name", source)
    return d


def _link(d: Mapping[str, Any]) -> tuple[float, float]:
    """(latency s, seconds per byte) of a link description."""
    return float(d.get("latency_us", 0.0)) * 1e-6, 1.0 / (float(d["bandwidth_GBps"]) * 1e9)


def cluster_model(description: Mapping[str, Any], world: int) -> MachineModel:
    """The ``MachineModel`` of ``world`` ranks of the described cluster."""
    per_node = int(description["ranks_per_node"])
    a_in, b_in = _link(description["intra_node"])
    a_out, b_out = _link(description["inter_node"])
    mem_b = 1.0 / (float(description["memory_bandwidth_GBps"]) * 1e9)

    def collective(op: Op, transport: TransportKind, nbytes: float, group: int) -> float:
        g = min(per_node, group)
        n = math.ceil(group / g)
        if n > 1 and transport is TransportKind.TORCH_DISTRIBUTED:
            # one flat ring pass over every rank: the slowest edge bounds it
            w = group
            one_pass = (w - 1) / w * nbytes * max(b_in, b_out / g) + (w - 1) * max(a_in, a_out)
        else:
            # one pass in two levels: inside the node, then the node's 1/g across the nodes
            inside = (g - 1) / g * nbytes * b_in + (g - 1) * a_in
            across = (n - 1) / n * (nbytes / g) * b_out + (n - 1) * a_out
            one_pass = inside + across
        cost = spec(op).comm_cost
        gamma = nbytes * mem_b if cost.reduces else 0.0  # reading what is reduced
        if cost.traffic is Traffic.RING:
            return cost.ring_passes * one_pass + gamma
        if cost.traffic is Traffic.POINT_TO_POINT:
            return a_out + nbytes * b_out
        # rooted (broadcast, reduce): one pipelined pass of the whole tensor
        return nbytes * (b_out if n > 1 else b_in) + (a_out if n > 1 else a_in) + gamma

    launch = float(description.get("kernel_launch_us", 5.0)) * 1e-6
    return MachineModel(
        description=f"cluster description: {description.get('name')} ({world} ranks, "
        f"{per_node} per node)",
        world=world,
        collectives={},
        memory=Curve(0.0, mem_b),  # the launch is op_overhead
        flops=float(description["peak_tflops"]) * 1e12,
        control={
            t: float(description.get("step_overhead_us", 0.0)) * 1e-6 / 2
            for t in (TransportKind.TORCH_DISTRIBUTED, TransportKind.HIERARCHICAL)
        },
        op_overhead=launch,
        overlap=float(description.get("overlap", 0.0)),
        formula=collective,
    )
