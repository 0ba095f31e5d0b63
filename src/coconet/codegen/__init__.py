"""Code generation: a scheduled program -> a readable per-rank Python module + fused kernels.

``lower`` orders the program into per-rank steps (computations, fused kernels, collective
start/wait pairs); ``forms`` says which units a transport runs in a form of its own (one pass,
read in place); ``emit`` writes them as Python source; ``KernelSet`` compiles the fused kernels;
``geometry`` binds run-time sizes. ``coconet.compile`` (in ``coconet.compiler``) drives them.
"""

from coconet.codegen.emit import emit
from coconet.codegen.forms import Form, Forms, forms
from coconet.codegen.geometry import Geometry, bind_sizes, geometry, resolve_shape
from coconet.codegen.kernels import KernelSet
from coconet.codegen.loader import load_module
from coconet.codegen.names import Namer
from coconet.codegen.plan import Compute, Kernel, Plan, Start, Step, Wait, lower

__all__ = [
    "Compute",
    "Form",
    "Forms",
    "Geometry",
    "Kernel",
    "KernelSet",
    "Namer",
    "Plan",
    "Start",
    "Step",
    "Wait",
    "bind_sizes",
    "emit",
    "forms",
    "geometry",
    "load_module",
    "lower",
    "resolve_shape",
]
