"""Make SGLang's disaggregation modules importable on a CPU-only test machine.

SGLang 0.5.23 is installed with ``--no-deps`` (plus ``orjson``, ``ipython``,
``traitlets``; see the README): its hard dependencies pin CUDA builds of torch and
friends. ``sglang.srt.disaggregation.utils`` imports ``sglang.srt.configs``, whose
multimodal configs import ``torchvision`` at module level; PyPI only has CUDA builds of
torchvision, which fail to import against the CPU torch here. torchvision plays no part
in KV transfer, so when it cannot be imported it is stubbed with SGLang's own mock module
type (``sglang._platform_stubs._MockModule``, what SGLang uses for triton on macOS) --
after ``transformers`` has recorded that torchvision is unavailable, so transformers
keeps its torchvision-free paths. Everything under ``sglang.srt.disaggregation`` and
``sglang.srt.plugins`` is SGLang's real code.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sys
import textwrap
from pathlib import Path
from typing import Any

PLUGIN_GROUP = "sglang.srt.plugins"


def have_sglang() -> bool:
    return importlib.util.find_spec("sglang") is not None


def _torchvision_imports() -> bool:
    try:
        importlib.import_module("torchvision")
    except Exception:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        return False
    return True


class _StubFinder:
    def __init__(self, mock: Any) -> None:
        self.mock = mock

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            mod = sys.modules.get(fullname) or self.mock(fullname)
            sys.modules[fullname] = mod
            return mod.__spec__
        return None


def prepare_imports() -> None:
    """Stub torchvision if (and only if) it cannot be imported. Idempotent."""
    if any(isinstance(f, _StubFinder) for f in sys.meta_path) or _torchvision_imports():
        return
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # cache "unavailable" before the stub exists
    from sglang._platform_stubs import _MockModule

    sys.meta_path.insert(0, _StubFinder(_MockModule))


def load_kvd_plugin(tmp: Path) -> None:
    """Run SGLang's real ``load_plugins()`` with kvd's entry point visible.

    If the installed kvd already declares ``sglang.srt.plugins: kvd`` (pyproject), that
    is what SGLang finds; otherwise a throwaway ``.dist-info`` declaring the same entry
    point is put on ``sys.path``, exactly what ``pip install`` would leave.
    """
    eps = importlib.metadata.entry_points(group=PLUGIN_GROUP)
    if not any(ep.name == "kvd" for ep in eps):
        dist = tmp / "kvd_sglang_entry-0.0.0.dist-info"
        dist.mkdir(parents=True, exist_ok=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvd-sglang-entry\n"
                                       "Version: 0.0.0\n")
        (dist / "entry_points.txt").write_text(textwrap.dedent(f"""\
            [{PLUGIN_GROUP}]
            kvd = kvd.adapters.sglang.plugin:register
            """))
        sys.path.insert(0, str(tmp))
        importlib.invalidate_caches()
    from sglang.srt.plugins import load_plugins

    load_plugins()
