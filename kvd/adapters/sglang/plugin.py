"""SGLang plugin: adds ``kvd`` to ``--disaggregation-transfer-backend`` without patching
SGLang's files.

SGLang has no registry of transfer backends: ``TransferBackend`` is a closed ``Enum``
and ``get_kv_class`` a chain of ``if``s (``sglang/srt/disaggregation/utils.py``). Its
general plugin framework can still add one: every SGLang process calls
``sglang.srt.plugins.load_plugins()``, which runs each ``sglang.srt.plugins`` entry
point and then applies the hooks they registered (``HookRegistry.apply_hooks``, which
also rebinds names that other modules imported with ``from ... import``). :func:`register`
(the entry point) does three things:

1. ``add_disagg_transfer_backend_choices(["kvd"])`` -- SGLang's own extension point for
   the CLI choices of ``--disaggregation-transfer-backend``;
2. a class ``REPLACE`` hook on ``TransferBackend``: the same enum plus ``KVD = "kvd"``
   (every original member keeps its name and value);
3. an ``AROUND`` hook on ``get_kv_class``: for ``kvd`` it returns SGLang's ``KVArgs`` and
   kvd's manager, sender, receiver and bootstrap-server classes
   (:mod:`kvd.adapters.sglang.conn`); any other backend goes to SGLang's function.

Declared in kvd's package metadata as::

    [project.entry-points."sglang.srt.plugins"]
    kvd = "kvd.adapters.sglang.plugin:register"

``SGLANG_PLUGINS=kvd`` restricts SGLang to this plugin when several are installed.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

BACKEND = "kvd"
UTILS = "sglang.srt.disaggregation.utils"


def transfer_backend_with_kvd(original: type[Enum]) -> type[Enum]:
    """``original`` (SGLang's ``TransferBackend``) plus a ``KVD = "kvd"`` member."""
    if any(m.value == BACKEND for m in original):
        return original
    members = {m.name: m.value for m in original} | {"KVD": BACKEND}
    extended = Enum(original.__name__, members, module=original.__module__,  # type: ignore[misc]
                    qualname=original.__qualname__)
    extended.__doc__ = original.__doc__
    return extended


def is_kvd(transfer_backend: Any) -> bool:
    """Does ``transfer_backend`` (enum member or string) name kvd?"""
    return getattr(transfer_backend, "value", transfer_backend) == BACKEND


def kvd_classes() -> dict[str, Any]:
    """kvd's backend classes by ``KVClassType`` value."""
    from sglang.srt.disaggregation.base.conn import KVArgs

    from kvd.adapters.sglang.conn import (
        KvdKVBootstrapServer,
        KvdKVManager,
        KvdKVReceiver,
        KvdKVSender,
    )

    return {"kvargs": KVArgs, "manager": KvdKVManager, "sender": KvdKVSender,
            "receiver": KvdKVReceiver, "bootstrap_server": KvdKVBootstrapServer}


def get_kv_class_around(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    """AROUND hook of ``get_kv_class``: kvd's classes for ``kvd``, SGLang's otherwise."""
    if is_kvd(transfer_backend):
        return kvd_classes()[getattr(class_type, "value", class_type)]
    return original(transfer_backend, class_type)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (runs inside ``load_plugins()``)."""
    import importlib

    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND])
    utils = importlib.import_module(UTILS)
    HookRegistry.register(f"{UTILS}.TransferBackend",
                          transfer_backend_with_kvd(utils.TransferBackend), HookType.REPLACE)
    HookRegistry.register(f"{UTILS}.get_kv_class", get_kv_class_around, HookType.AROUND)
