"""S17: the engine's client proves its daemon (SO_PEERCRED) before it sends a byte."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.client import KvdClient
from kvd.client.peer import EXPECTED_UID_ENV, folder_owner, parse_expected_uid, trust_for
from kvd.errors import KvdUnreachable, UntrustedDaemon
from kvd.protocol import rpc
from tests.helpers.squatter import NOBODY, Squatter


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder in /tmp that another user can reach (pytest's tmp_path is root's 0700)."""
    base = Path(tempfile.mkdtemp(prefix="kvd-s17-", dir="/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _folder(path: Path, uid: int, mode: int) -> Path:
    path.mkdir()
    os.chown(path, uid, uid)
    path.chmod(mode)
    return path


def _refused_before_sending(sock: Path, **client: object) -> UntrustedDaemon:
    with Squatter(sock) as squatter:
        with pytest.raises(UntrustedDaemon) as exc:
            KvdClient(str(sock), timeout=5, **client).call(rpc.Info())  # type: ignore[arg-type]
        assert squatter.bytes_received() == 0  # closed before RegisterKV/Info: nothing sent
    return exc.value


def test_s17_squatter_in_a_shared_sticky_folder_gets_nothing(shared: Path) -> None:
    tmp_like = _folder(shared / "tmp", 0, 0o1777)  # like /tmp: anyone may create entries
    err = _refused_before_sending(tmp_like / "kvd.sock")
    assert err.found_uid == NOBODY and NOBODY not in err.trusted
    assert f"uid {NOBODY}" in str(err) and "0 (root)" in str(err)
    assert "Nothing was sent" in str(err)


def test_s17_a_folder_the_squatter_made_in_tmp_vouches_for_nobody(shared: Path) -> None:
    # /tmp/<x> owned by the squatter: its owner could be anyone, /tmp lets everyone create
    own = Path(tempfile.mkdtemp(prefix="kvd-s17-squat-", dir="/tmp"))
    try:
        os.chown(own, NOBODY, NOBODY)
        own.chmod(0o755)
        assert folder_owner(str(own))[0] is None
        err = _refused_before_sending(own / "kvd.sock")
        assert "writable by others" in str(err) and EXPECTED_UID_ENV in str(err)
    finally:
        shutil.rmtree(own, ignore_errors=True)


def test_s17_squatter_in_a_group_writable_folder_is_refused(shared: Path) -> None:
    _refused_before_sending(_folder(shared / "open", 0, 0o777) / "kvd.sock")


def _accepted(sock: Path, **client: object) -> int:
    with Squatter(sock) as squatter:  # answers nothing: the call fails after sending
        with pytest.raises(KvdUnreachable):
            KvdClient(str(sock), timeout=5, **client).call(rpc.Info())  # type: ignore[arg-type]
        return squatter.bytes_received()


def test_s17_the_owner_of_a_folder_only_it_could_make_is_trusted(shared: Path) -> None:
    run = _folder(shared / "kvd", NOBODY, 0o750)  # like /run/kvd of a dedicated kvd user
    assert folder_owner(str(run)) == (NOBODY, "")
    assert _accepted(run / "kvd.sock") > 0  # the same server, now trusted, gets the request


def test_s17_an_expected_uid_is_trusted_wherever_the_socket_is(
        shared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp_like = _folder(shared / "tmp", 0, 0o1777)
    assert _accepted(tmp_like / "a.sock", expected_uid=NOBODY) > 0
    monkeypatch.setenv(EXPECTED_UID_ENV, str(NOBODY))
    assert _accepted(tmp_like / "b.sock") > 0
    monkeypatch.setenv(EXPECTED_UID_ENV, "1")  # another expected uid: 65534 refused again
    _refused_before_sending(tmp_like / "c.sock")


def test_s17_symlinks_are_followed_and_their_folders_checked(shared: Path) -> None:
    run = _folder(shared / "kvd", NOBODY, 0o750)
    (shared / "link").symlink_to("kvd")  # in a root 0755 folder: fine
    assert folder_owner(str(shared / "link")) == (NOBODY, "")
    squat = _folder(shared / "open", 0, 0o777)
    (squat / "link").symlink_to(run)  # a link in a folder others can write vouches nothing
    owner, why = folder_owner(str(squat / "link"))
    assert owner is None and str(squat) in why


def test_s17_root_and_this_user_are_always_trusted(tmp_path: Path) -> None:
    trust = trust_for(str(tmp_path / "kvd.sock"), None)
    assert {0, os.geteuid()} <= trust.uids.keys()


@pytest.mark.parametrize("value", ["x", "-1", "1.5"])
def test_s17_a_bad_expected_uid_is_a_clear_error(value: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="uid"):
        parse_expected_uid(value)
    monkeypatch.setenv(EXPECTED_UID_ENV, value)
    with pytest.raises(ValueError, match="uid"):
        KvdClient("/nonexistent/kvd.sock")
