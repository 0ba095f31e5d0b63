"""The N-virtual-rank reference simulator: the definition of what a program means.

``reassociations(original, scheduled)`` (``coconet.sim.exactness``) says where a scheduled program
may differ from its program in the last bits, and why; elsewhere the two are bitwise equal.
"""

from coconet.sim.exactness import reassociations
from coconet.sim.simulator import SimResult, simulate

__all__ = ["SimResult", "reassociations", "simulate"]
