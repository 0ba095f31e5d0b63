"""The autotuner: enumerate a program's legal schedules, predict them with a calibrated cost
model, measure the most promising on the real ranks, choose, cache and explain.

- ``coconet.tune.candidates``: ``Candidate`` (a schedule + transport + algorithms) and the
  enumeration;
- ``coconet.tune.cost``: ``Curve`` (alpha-beta), ``MachineModel``, ``predict``;
- ``coconet.tune.calibrate``: the micro-benchmarks that make a ``MachineModel``;
- ``coconet.tune.cluster``: machine models from written cluster descriptions (``coconet plan``);
- ``coconet.tune.measure``: timing candidates on the ranks;
- ``coconet.tune.store``: the cache;
- ``coconet.tune.tuner``: ``tune`` and ``TuneResult`` (``explain()``).
"""

from coconet.tune.candidates import Candidate, enumerate_candidates, enumerate_schedules
from coconet.tune.cost import Curve, MachineModel, Prediction, predict
from coconet.tune.tuner import Row, TuneResult, tune

__all__ = [
    "Candidate",
    "Curve",
    "MachineModel",
    "Prediction",
    "Row",
    "TuneResult",
    "enumerate_candidates",
    "enumerate_schedules",
    "predict",
    "tune",
]
