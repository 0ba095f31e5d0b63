"""``coconet plan``: predicted step times of every candidate at world sizes no one here can run.

No processes: each candidate, on each transport that runs across nodes (torch.distributed's flat
rings, and two levels where nodes hold 2+ ranks: ``coconet.runtime.hierarchy``), is predicted by
the cost model of a written cluster description (``coconet.tune.cluster``) at each world size,
and the table shows where each schedule and transport pays. A prediction, not a measurement: it
is as good as the description's bandwidths and the model's assumptions (rings, streaming
kernels at memory bandwidth, overlap as described).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coconet.ir.program import Program
from coconet.options import CommitMode, TransportKind
from coconet.schedule import paper
from coconet.tune.candidates import CHUNKS, Candidate, enumerate_candidates
from coconet.tune.cluster import cluster_model
from coconet.tune.cost import Prediction, predict

__all__ = ["PlanTable", "plan"]


@dataclass
class PlanTable:
    program: Program
    sizes: dict[str, int]
    description: str
    worlds: list[int]
    candidates: list[Candidate]
    predictions: dict[int, list[Prediction]]  # world -> one per candidate, in order

    def best(self, world: int) -> Prediction:
        """The fastest predicted; among equal predictions (the same program reached by a
        recipe and by the paper's schedule), the one with the paper's name."""
        preds = self.predictions[world]
        fastest = min(p.seconds for p in preds)
        tied = [p for p in preds if p.seconds <= fastest * (1 + 1e-9)]
        return next((p for p in tied if p.candidate.name in paper.__all__), tied[0])

    def format(self) -> str:
        sizes = ", ".join(f"{k}={v:,}" for k, v in self.sizes.items())
        lines = [
            f"coconet plan: {self.program.name} with {sizes}",
            f"cost model: {self.description}",
            f"predicted ms per step ({self._legend()}); * marks the best at each world size",
            "",
        ]
        names = [c.label for c in self.candidates]
        width = max(len(n) for n in names)
        head = "schedule".ljust(width) + "".join(f"{w:>11}" for w in self.worlds)
        lines += [head, "-" * len(head)]
        best = {w: self.best(w) for w in self.worlds}
        for i, name in enumerate(names):
            cells = []
            for w in self.worlds:
                p = self.predictions[w][i]
                mark = "*" if p is best[w] else " "
                cells.append(f"{p.ms:>10.2f}{mark}")
            lines.append(name.ljust(width) + "".join(cells))
        lines.append("")
        for w in self.worlds:
            b = best[w]
            kinds = ", ".join(f"{k} {1e3 * s:.2f}" for k, s in b.by_kind().items() if s > 0)
            lines.append(f"{w:>5} ranks: best {b.candidate.label} {b.ms:.2f} ms ({kinds})")
        return "\n".join(lines)

    def _legend(self) -> str:
        what = {
            TransportKind.TORCH_DISTRIBUTED: "flat rings over every rank",
            TransportKind.HIERARCHICAL: "two levels, inside each node and across",
        }
        used = dict.fromkeys(c.transport for c in self.candidates)
        return "; ".join(f"[{t.value}]: {what[t]}" for t in used)

    def to_json(self) -> dict[str, Any]:
        return {
            "program": self.program.name,
            "sizes": self.sizes,
            "cluster": self.description,
            "worlds": self.worlds,
            "candidates": [
                {
                    "schedule": str(c),
                    "predicted_ms": {str(w): self.predictions[w][i].ms for w in self.worlds},
                }
                for i, c in enumerate(self.candidates)
            ],
            "best": {str(w): str(self.best(w).candidate) for w in self.worlds},
        }


def plan(
    program: Program,
    sizes: Mapping[str, int],
    description: Mapping[str, Any],
    worlds: Sequence[int],
    *,
    state: Sequence[str] = (),
    chunks: Sequence[int] = CHUNKS,
    commit: CommitMode = CommitMode.SWAP,
) -> PlanTable:
    """Predict every candidate of ``program`` at each world size on the described cluster."""
    transports = [TransportKind.TORCH_DISTRIBUTED]
    if description.get("device", "cuda") == "cpu" and int(description["ranks_per_node"]) >= 2:
        # two levels run over shared memory: CPU hosts (NCCL has its own topology-aware rings)
        transports.append(TransportKind.HIERARCHICAL)
    candidates, _ = enumerate_candidates(program, transports, chunks, state)
    predictions: dict[int, list[Prediction]] = {}
    name = ""
    for w in worlds:
        model = cluster_model(description, w)
        name = model.description.split(" (")[0]
        predictions[w] = [predict(c, sizes, model, w, commit=commit) for c in candidates]
    return PlanTable(program, dict(sizes), name, list(worlds), candidates, predictions)
