"""The N-virtual-rank reference simulator: the definition of what a program means.

``reassociations(original, scheduled)`` (``coconet.sim.exactness``) says where a scheduled program
may differ from its program in the last bits, and why; elsewhere the two are bitwise equal.
``reference_grad`` differentiates a simulated step with ``torch.autograd``
(``coconet.sim.reference``): what ``coconet.grad``'s programs are checked against.
"""

from coconet.sim.exactness import reassociations
from coconet.sim.reference import reference_grad
from coconet.sim.simulator import SimResult, simulate

__all__ = ["SimResult", "reassociations", "reference_grad", "simulate"]
