"""The test tree itself: every test module can be collected beside every other one."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_modules_outside_packages_have_unique_basenames() -> None:
    """pytest imports a test module whose folder has no ``__init__.py`` under its bare
    basename (rootdir-relative "prepend" import mode), so two such modules with one name
    cannot be collected in one run ("import file mismatch"): the second one errors, and
    which one depends on xdist's split. ``tests/unit/rooms`` imports its ``roomkit``
    helper by bare name, so those folders stay non-packages and their names unique."""
    bare: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if "__pycache__" in path.parts or (path.parent / "__init__.py").exists():
            continue
        bare[path.stem].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in bare.items() if len(paths) > 1}
    assert not clashes, f"modules that would import under one name: {clashes}"
