"""The side-channel secret of a node: the configured one, or one per user and host, made on first use.

A side channel without a secret answers anyone who reaches it, and its handshake hands out what
lets its holder read and write the node's KV cache (NIXL metadata, a CUDA IPC handle). Loopback
does not make that safe: every process of the host reaches it, other users' and other containers'
of the network namespace included. So a node always has a secret unless told to run without one:

1. KVBRIDGE_SIDE_CHANNEL_SECRET, at least 32 bytes: a cluster's secret, set on every node (any
   host, any user) and on the proxy.
2. Else, with `--insecure-side-channel` (the connector option `insecure_side_channel`): none.
3. Else the host secret: the file `side-channel-secret` in a directory only this user can enter,
   `$XDG_RUNTIME_DIR/kvbridge` (the login session's private tmpfs) when that runtime directory is
   this user's, else `<tempdir>/kvbridge-<uid>`. The first node to start creates it (64 random hex
   characters, mode 0600, written to a private temporary name and linked into place, so a reader
   never sees a partial file and two nodes starting together agree on one secret); every later node,
   proxy or `KVBridgeConnector` of that user on that host reads it. A directory or file that is not
   this user's, is a link, or is open to group or others is refused with a ConfigError naming it:
   another user could have planted or read it.

Processes of one user on one host thus authenticate one another with no setting, and processes of
anyone else (another user, a container that does not share the directory) are refused before their
first frame is decoded.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

from kvbridge import env
from kvbridge.errors import ConfigError
from kvbridge.transfer.auth import check_secret

SECRET_FILE_NAME = "side-channel-secret"
_SECRET_HEX_CHARS = 64  # 32 random bytes, written as hex so that the file's text works as the env variable too
_FIX = "or set the same KVBRIDGE_SIDE_CHANNEL_SECRET (at least 32 bytes) on every node and the proxy"


def side_channel_secret(insecure: bool = False) -> bytes | None:
    """The secret a node, proxy or connector signs side-channel frames with; None only when `insecure`
    and none is configured. Raises ConfigError for a secret that is too short or a host secret file
    that cannot be trusted or made."""
    configured = env.side_channel_secret()
    if configured is not None:
        check_secret(configured, "KVBRIDGE_SIDE_CHANNEL_SECRET")
        return configured
    if insecure:
        return None
    return host_secret()


def runtime_dir() -> Path:
    """The per-user directory that holds the host secret (see the module docstring)."""
    uid = os.getuid()
    xdg = env.xdg_runtime_dir()
    if xdg:
        try:
            st = os.stat(xdg)
        except OSError:
            st = None
        if st is not None and stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077:
            return Path(xdg) / "kvbridge"
    return Path(tempfile.gettempdir()) / f"kvbridge-{uid}"


def host_secret(directory: Path | None = None) -> bytes:
    """This user's host secret in `directory` (default: `runtime_dir()`), created if there is none."""
    directory = directory or runtime_dir()
    _ensure_private_dir(directory)
    path = directory / SECRET_FILE_NAME
    try:
        return _read(path)
    except FileNotFoundError:
        _create(path)
    return _read(path)


def _ensure_private_dir(path: Path) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"cannot create {path} for the side-channel secret: {e.strerror}; {_FIX}") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(
            f"{path} (where this user's side-channel secret lives) is not a directory of uid {os.getuid()} "
            f"with mode 0700 (it is uid {st.st_uid}, mode {stat.filemode(st.st_mode)}): another user may have made it. "
            f"Remove it, {_FIX}"
        )


def _create(path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secrets.token_hex(_SECRET_HEX_CHARS // 2).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic; fails when another process linked its secret first: then that one holds
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"cannot create the side-channel secret {path}: {e.strerror}; {_FIX}") from None
    finally:
        os.unlink(tmp)


def _read(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: a symbolic link, which someone else may point anywhere
        raise ConfigError(f"cannot read the side-channel secret {path}: {e.strerror}; remove it, {_FIX}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ConfigError(
                f"refusing the side-channel secret {path}: it must be a regular file of uid {os.getuid()} with mode "
                f"0600 (it is uid {st.st_uid}, mode {stat.filemode(st.st_mode)}); remove it, {_FIX}"
            )
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    check_secret(data, f"the side-channel secret file {path}")
    return data
