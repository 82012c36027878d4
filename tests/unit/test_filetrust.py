"""S22: secret files are read as OpenSSH reads keys -- kvd's user or root owns them, nobody
else may read them or swap them (folders on the way); the path walk behind it (S17)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvd.config import load_settings, read_secret
from kvd.errors import ConfigError
from kvd.filetrust import check_secret_file, path_problem, read_secret_file, walk

SECRET = "0123456789abcdef0123456789abcdef"
NOBODY = 65534

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def _secret(folder: Path, mode: int = 0o600, uid: int | None = None) -> Path:
    path = folder / "cluster.secret"
    path.write_text(SECRET + "\n")
    path.chmod(mode)
    if uid is not None:
        os.chown(path, uid, uid)
    return path


def _folder(path: Path, mode: int) -> Path:
    path.mkdir()
    path.chmod(mode)
    return path


@needs_root
def test_s22_a_secret_file_of_another_user_is_refused(tmp_path: Path) -> None:
    path = _secret(tmp_path, 0o600, NOBODY)
    for check in ("refuse", "warn"):  # the owner is never only warned about
        s = load_settings(role="decode", cluster_secret_file=str(path),
                          cluster_secret_file_check=check)
        with pytest.raises(ConfigError, match=f"belongs to uid {NOBODY}, not to kvd's user"
                                              f" \\(uid 0\\) or root") as exc:
            read_secret(s)
        assert SECRET not in str(exc.value)
    with pytest.raises(ConfigError, match="belongs to uid"):
        check_secret_file(path, "proxy_token_file")
    os.chown(path, 0, 0)
    assert read_secret(load_settings(role="decode", cluster_secret_file=str(path))) == \
        SECRET.encode()


def test_s22_a_folder_others_may_write_is_refused_a_sticky_one_is_not(tmp_path: Path) -> None:
    open_ = _secret(_folder(tmp_path / "open", 0o777))
    with pytest.raises(ConfigError, match=r"is writable by others .* could swap the file"):
        read_secret_file(open_, "cluster_secret_file")
    group = _secret(_folder(tmp_path / "group", 0o770))
    with pytest.raises(ConfigError, match="writable by others"):
        check_secret_file(group)
    sticky = _secret(_folder(tmp_path / "sticky", 0o1777))  # our own entry: nobody can swap it
    assert read_secret_file(sticky) == (SECRET + "\n").encode()


@needs_root
def test_s22_a_link_planted_in_an_open_folder_cannot_point_at_a_known_root_file(
        tmp_path: Path) -> None:
    """A user who may write the secret's folder points the path at a root-owned 0600 file
    whose first line is well known (an SSH host key's header): refused."""
    key = tmp_path / "host_key"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nxxxx\n")
    key.chmod(0o600)
    shared = _folder(tmp_path / "shared", 0o777)
    (shared / "cluster.secret").symlink_to(key)
    with pytest.raises(ConfigError, match="writable by others"):
        read_secret(load_settings(role="decode", cluster_secret_file=str(shared /
                                                                         "cluster.secret")))
    sticky = _folder(tmp_path / "sticky", 0o1777)
    link = sticky / "cluster.secret"
    link.symlink_to(key)
    os.lchown(link, NOBODY, NOBODY)  # another user's link in a sticky folder: theirs
    with pytest.raises(ConfigError, match="writable by others"):
        check_secret_file(link)


def test_s22_a_fifo_or_folder_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    for path in (fifo, tmp_path):
        with pytest.raises(ConfigError, match="not a regular file"):
            read_secret_file(path)


def test_s22_walk_follows_links_and_records_each_folder(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("x")
    (tmp_path / "l").symlink_to("a")
    (tmp_path / "abs").symlink_to(tmp_path / "l" / "f")
    looked, resolved = walk(str(tmp_path / "abs"))
    assert resolved == str(tmp_path / "a" / "f")
    folders = [step.folder for step in looked]
    assert folders[0] == "/" and str(tmp_path) in folders and str(tmp_path / "a") in folders
    assert path_problem(str(tmp_path / "abs"), (os.geteuid(), 0)) is None
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(OSError):
        walk(str(tmp_path / "loop"))
