"""The daemon: one asyncio loop that owns every room, peer and resource of one GPU's kvd.

Everything here performs effects the pure machines (:mod:`kvd.rooms`,
:mod:`kvd.membership`) decide; protocol, planning and state-machine code lives outside
this package and does no I/O (docs/architecture.md, "where a change goes").

* :mod:`kvd.daemon.main` -- :class:`Daemon` (start, loops, stop) and :func:`serve`;
* :mod:`kvd.daemon.core` -- what both roles share (control plane, executor, engine
  memory, counters);
* :mod:`kvd.daemon.side` -- a role's common half, :mod:`kvd.daemon.prefill` and
  :mod:`kvd.daemon.decode` the two roles;
* :mod:`kvd.daemon.status` -- the operations views.
"""

from kvd.daemon.main import Daemon, serve

__all__ = ["Daemon", "serve"]
