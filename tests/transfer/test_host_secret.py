"""The host secret: made once per user and directory, private, shared by processes that start together,
and refused by name wherever another user could have planted or read it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvbridge.errors import ConfigError
from kvbridge.transfer.host_secret import SECRET_FILE_NAME, host_secret, side_channel_secret


def test_made_once_private_and_reused(tmp_path):
    directory = tmp_path / "kvbridge"
    first = host_secret(directory)
    assert len(first) == 64 and host_secret(directory) == first
    assert (directory.stat().st_mode & 0o777, (directory / SECRET_FILE_NAME).stat().st_mode & 0o777) == (0o700, 0o600)
    assert [p.name for p in directory.iterdir()] == [SECRET_FILE_NAME]  # no temporary file left behind


def test_processes_that_start_together_agree_on_one_secret(tmp_path):
    code = "import sys; from pathlib import Path; from kvbridge.transfer.host_secret import host_secret; " \
           "print(host_secret(Path(sys.argv[1])).decode())"  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "d")], stdout=subprocess.PIPE, text=True)
             for _ in range(4)]  # fmt: skip
    secrets = {proc.communicate(timeout=60)[0].strip() for proc in procs}
    assert len(secrets) == 1 and len(secrets.pop()) == 64


@pytest.mark.parametrize("fault", ["file-mode", "dir-mode", "symlink", "short"])
def test_an_untrustworthy_secret_is_refused_by_name(tmp_path, fault):
    directory = tmp_path / "kvbridge"
    path = directory / SECRET_FILE_NAME
    directory.mkdir(mode=0o700)
    if fault == "symlink":
        (tmp_path / "planted").write_text("p" * 64)
        path.symlink_to(tmp_path / "planted")
    else:
        path.write_text("s" * (16 if fault == "short" else 64))
        path.chmod(0o644 if fault == "file-mode" else 0o600)
    if fault == "dir-mode":
        directory.chmod(0o755)
    with pytest.raises(ConfigError, match=str(directory)):
        host_secret(directory)


def test_the_configured_secret_wins_and_a_short_one_is_refused_by_name(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    tmp_path.chmod(0o700)
    monkeypatch.setenv("KVBRIDGE_SIDE_CHANNEL_SECRET", "c" * 32)
    assert side_channel_secret() == b"c" * 32
    monkeypatch.setenv("KVBRIDGE_SIDE_CHANNEL_SECRET", "c" * 31)
    with pytest.raises(ConfigError, match="KVBRIDGE_SIDE_CHANNEL_SECRET is 31 bytes"):
        side_channel_secret()
    monkeypatch.delenv("KVBRIDGE_SIDE_CHANNEL_SECRET")
    assert side_channel_secret(insecure=True) is None
    assert side_channel_secret() == (tmp_path / "kvbridge" / SECRET_FILE_NAME).read_bytes()
    assert os.listdir(tmp_path) == ["kvbridge"]
