"""Fixtures of the in-process tier (see harness.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.inproc.harness import Cluster


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        await c.stop()
