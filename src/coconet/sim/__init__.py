"""The N-virtual-rank reference simulator: the definition of what a program means."""

from coconet.sim.simulator import SimResult, simulate

__all__ = ["SimResult", "simulate"]
