"""The registry of per-transport emissions: the transports whose forms
(``coconet.codegen.forms.REGISTRY``) write some units otherwise than the generic emitter's default
lowering, each with its ``coconet.codegen.lowering.Emission``. A transport whose units all run
plainly needs no entry (a test checks that every transport with forms has one).
"""

from __future__ import annotations

from collections.abc import Callable

from coconet.codegen.emit_shm import SharedMemoryEmission
from coconet.codegen.lowering import Emission, Emitter
from coconet.options import TransportKind

__all__ = ["EMISSIONS"]

EMISSIONS: dict[TransportKind, Callable[[Emitter], Emission]] = {
    TransportKind.SHARED_MEMORY: SharedMemoryEmission,
}
