"""Integer bounds on the wire: the one definition every message module uses. PURE.

msgpack carries no integer outside ``[-2**63, 2**64)``; within it, a value outside its
field's bound does not decode (:class:`~kvd.errors.ProtocolError` naming the field, e.g.
``Expected `int` >= 0 - at `$.room```). The engine RPC (:mod:`kvd.protocol.rpc`), the
control plane (:mod:`kvd.protocol.control`) and the memory handles and exported pool both
carry (:mod:`kvd.protocol.memory`) take their integer types from here, so an integer kvd
accepts from an engine is one its peers accept from kvd (case S19).

This module imports nothing from kvd: it is a leaf below every other protocol module.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = ["I64", "I64_MAX", "Address", "Count", "RoomId", "Size"]

I64_MAX = (1 << 63) - 1
#: A room id: a 64-bit unsigned integer (the status table and every numpy view of room
#: ids hold them as ``uint64``; msgspec takes no bound past int64, so only ``ge`` is
#: written).
RoomId = Annotated[int, msgspec.Meta(ge=0)]
#: An address in the owning process's address space (u64).
Address = Annotated[int, msgspec.Meta(ge=0)]
#: A signed 64-bit integer (what the room machines' numpy arrays hold): an index that may
#: carry a sentinel (``state_index`` -1: none), as the engine may name it.
I64 = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=I64_MAX)]
#: A page index, count, size or offset (bytes), layer, head, descriptor position or
#: incarnation: ``[0, 2**63)``.
Count = Annotated[int, msgspec.Meta(ge=0, le=I64_MAX)]
#: A parallel size: at least 1, at most int64.
Size = Annotated[int, msgspec.Meta(ge=1, le=I64_MAX)]
