"""docs/cases.md against the test tree: every case is listed, every test it names exists,
and every case has a test carrying its id, one of them on real processes. Pure: parses
files only."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
DOC = ROOT / "docs" / "cases.md"

CASES = [f"K{i:02d}" for i in range(1, 37)] + [f"S{i:02d}" for i in range(1, 16)]
#: Third-round cases (K37-K46, S16-S22): each is required once the doc has its row; a row is
#: added with the work that rules the case out (docs/cases.md "Third round").
LATER = [f"K{i:02d}" for i in range(37, 47)] + [f"S{i:02d}" for i in range(16, 23)]
TIERS = {"unit": 1, "inproc": 2, "integration": 3, "e2e": 3, "adapters": 3}
REAL = {"integration", "e2e", "adapters"}
#: Cases allowed, for now, to lack an id-carrying test on real processes. Keep it empty:
#: a case listed here is a case whose fix nobody checked end to end.
KNOWN_MISSING: set[str] = set()

ROW = re.compile(r"^\|\s*([KS]\d\d)\s*\|(.*)\|\s*$")
SEGMENT = re.compile(r"T(\d)\s+`([^`]+\.py)`:(.*)")
TICKED = re.compile(r"`([^`]+)`")
IDS = re.compile(r"^test_((?:[ks]\d\d[a-z]?_)+)")


@cache
def defined(rel: str) -> frozenset[str]:
    """Test names defined in ``tests/<rel>``: functions, classes and module-level
    ``Test*`` assignments (hypothesis state machines)."""
    path = TESTS / rel
    if not path.is_file():
        return frozenset()
    tree = ast.parse(path.read_text(), str(path))
    names = {n.name for n in ast.walk(tree)
             if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}
    names |= {t.id for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and t.id.startswith("Test")}
    return frozenset(names)


def carried(name: str) -> set[str]:
    """Case ids a test name carries: ``test_k01_k02_x`` carries K01 and K02."""
    m = IDS.match(name)
    return {i[:3].upper() for i in m.group(1).split("_") if i} if m else set()


def expand(rel: str, name: str) -> list[str]:
    """The tests of ``tests/<rel>`` a listed name stands for (trailing ``*``: a prefix)."""
    if name.endswith("*"):
        return sorted(n for n in defined(rel) if n.startswith(name[:-1]))
    return [name] if name in defined(rel) else []


@cache
def rows() -> dict[str, list[tuple[int, str, str]]]:
    """Case id -> (tier, file under tests/, listed name) from the doc's tables."""
    out: dict[str, list[tuple[int, str, str]]] = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if not m:
            continue
        cid, tests_cell = m.group(1), m.group(2).rsplit("|", 1)[-1]
        assert cid not in out, f"{cid} has two rows"
        entries = out[cid] = []
        for seg in tests_cell.split("<br>"):
            s = SEGMENT.match(seg.strip())
            assert s, f"{cid}: tests cell segment {seg.strip()!r} is not 'T<n> `file.py`: names'"
            tier, rel = int(s.group(1)), s.group(2)
            names = TICKED.findall(s.group(3))
            assert names, f"{cid}: no test named for {rel}"
            entries += [(tier, rel, n) for n in names]
    return out


def required() -> list[str]:
    """Every first- and second-round case, and each third-round case the doc has a row for."""
    return CASES + [c for c in LATER if c in rows()]


def test_every_case_is_in_the_doc() -> None:
    assert sorted(rows()) == sorted(required())


def test_every_listed_test_exists_in_its_tier() -> None:
    problems = []
    for cid, entries in rows().items():
        for tier, rel, name in entries:
            top = rel.split("/")[0]
            if TIERS.get(top) != tier:
                problems.append(f"{cid}: {rel} is not tier {tier}")
            elif not (TESTS / rel).is_file() and not name.endswith("*"):
                problems.append(f"{cid}: tests/{rel} does not exist")
            elif not expand(rel, name):
                problems.append(f"{cid}: no {name} in tests/{rel}")
    assert not problems, "\n".join(problems)


def test_every_case_has_an_id_carrying_test_on_real_processes() -> None:
    missing = []
    for cid in required():
        tests = [(rel, n) for _, rel, name in rows().get(cid, [])
                 for n in expand(rel, name) if cid in carried(n)]
        if not tests:
            missing.append(f"{cid}: no listed test carries its id")
        elif not any(rel.split("/")[0] in REAL for rel, _ in tests):
            missing.append(f"{cid}: no listed test carrying its id runs on real processes")
    missing = [m for m in missing if m[:3] not in KNOWN_MISSING]
    assert not missing, "\n".join(missing)


def test_the_doc_lists_every_id_carrying_test() -> None:
    listed = {(rel, n) for entries in rows().values() for _, rel, name in entries
              for n in expand(rel, name)}
    unlisted = [f"tests/{p.relative_to(TESTS)}::{n}"
                for p in sorted(TESTS.rglob("test_*.py"))
                for n in sorted(defined(str(p.relative_to(TESTS))))
                if carried(n) and (str(p.relative_to(TESTS)), n) not in listed]
    assert not unlisted, "tests carrying a case id but missing from docs/cases.md:\n" + \
        "\n".join(unlisted)


def test_docs_refer_to_nothing_outside_the_repo() -> None:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*"))]
    bad = [f"{f.relative_to(ROOT)}: {word}" for f in files if f.is_file()
           for word in ("../shared", "/work/") if word in f.read_text(errors="replace")]
    assert not bad, "\n".join(bad)
