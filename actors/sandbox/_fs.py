"""Host-side file operations on an untrusted workspace tree.

The sandbox writes whatever it likes into its workspace, including symlinks to host paths
(``ln -s /root/.ssh/id_rsa x``) and FIFOs. The host (often root) must never follow them: every
path is walked one component at a time with ``O_NOFOLLOW`` relative to the previous directory's
fd, ``..`` is refused up front, and only regular files are read. Ownership of what the host
creates is handed to the sandbox's uid (``owner``) so the sandbox can modify it.

Also the host-state helpers both backends share (lock files, owner processes). All functions
are blocking; callers run them in a thread.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import sys
from pathlib import Path

from harnessrl.actors.sandbox.base import SandboxError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20

Owner = tuple[int, int] | None


def _split(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise SandboxError(f"path outside the workspace: {rel!r}")
    return parts


def _chown(owner: Owner, name: str | int, dir_fd: int | None = None) -> None:
    if owner is None:
        return
    if isinstance(name, int):
        os.fchown(name, *owner)
    else:
        os.chown(name, *owner, dir_fd=dir_fd, follow_symlinks=False)


def _open_dir(parent_fd: int, name: str, *, create: bool, owner: Owner) -> int:
    if create:
        try:
            os.mkdir(name, 0o755, dir_fd=parent_fd)
            _chown(owner, name, parent_fd)
        except FileExistsError:
            pass
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise SandboxError(f"not a plain directory (symlink?): {name!r}") from e
        raise


def _walk_to_parent(root: Path, parts: list[str], *, create: bool, owner: Owner) -> int:
    """An fd of the directory holding ``parts[-1]`` (or of the root when ``parts`` is empty)."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parts[:-1]:
            nfd = _open_dir(fd, part, create=create, owner=owner)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_regular(dir_fd: int, name: str, flags: int, mode: int = 0o644) -> int:
    try:
        fd = os.open(
            name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd
        )
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise SandboxError(f"not a regular file (symlink, FIFO, dir?): {name!r}") from e
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SandboxError(f"not a regular file: {name!r}")
    os.set_blocking(fd, True)
    return fd


def read_file(root: Path, rel: str, max_bytes: int) -> bytes:
    parts = _split(rel)
    if not parts:
        raise SandboxError("read_file needs a file path, got the workspace root")
    dfd = _walk_to_parent(root, parts, create=False, owner=None)
    try:
        fd = _open_regular(dfd, parts[-1], os.O_RDONLY)
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise SandboxError(f"{rel!r} is larger than {max_bytes} bytes")
    return data


def write_file(root: Path, rel: str, data: bytes, owner: Owner, mode: int = 0o644) -> None:
    parts = _split(rel)
    if not parts:
        raise SandboxError("write_file needs a file path, got the workspace root")
    dfd = _walk_to_parent(root, parts, create=True, owner=owner)
    try:
        fd = _open_regular(dfd, parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    finally:
        os.close(dfd)
    with os.fdopen(fd, "wb") as f:
        _chown(owner, f.fileno())
        f.write(data)


def make_dirs(root: Path, rel: str, owner: Owner) -> None:
    os.close(_walk_to_parent(root, [*_split(rel), "_"], create=True, owner=owner))


def copy_in(src: Path, root: Path, rel: str, owner: Owner) -> None:
    """Copy host ``src`` (file or tree, trusted) to workspace ``rel`` (untrusted)."""
    parts = _split(rel)
    if src.is_symlink() or not src.is_dir():
        if not parts:
            raise SandboxError("copying a file needs a destination file path")
        dfd = _walk_to_parent(root, parts, create=True, owner=owner)
        try:
            _copy_file_in(src, dfd, parts[-1], owner)
        finally:
            os.close(dfd)
        return
    dfd = _walk_to_parent(root, [*parts, "_"], create=True, owner=owner)
    try:
        _copy_tree_in(src, dfd, owner)
    finally:
        os.close(dfd)


def _copy_file_in(src: Path, dir_fd: int, name: str, owner: Owner) -> None:
    st = src.lstat()
    if stat.S_ISLNK(st.st_mode):
        _replace_non_dir(dir_fd, name)
        os.symlink(os.readlink(src), name, dir_fd=dir_fd)
        _chown(owner, name, dir_fd)
        return
    if not stat.S_ISREG(st.st_mode):
        return  # sockets, FIFOs, devices: skipped
    fd = _open_regular(dir_fd, name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
        shutil.copyfileobj(inp, out, _CHUNK)
        os.fchmod(out.fileno(), stat.S_IMODE(st.st_mode) & 0o777)
        _chown(owner, out.fileno())


def _replace_non_dir(dir_fd: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        raise SandboxError(f"a directory is in the way: {name!r}")
    os.unlink(name, dir_fd=dir_fd)


def _copy_tree_in(src: Path, dir_fd: int, owner: Owner) -> None:
    with os.scandir(src) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False):
                sub = _open_dir(dir_fd, entry.name, create=True, owner=owner)
                try:
                    _copy_tree_in(Path(entry.path), sub, owner)
                finally:
                    os.close(sub)
            else:
                _copy_file_in(Path(entry.path), dir_fd, entry.name, owner)


def copy_out(root: Path, dest: Path) -> None:
    """Copy the untrusted tree at ``root`` to a new or empty host directory ``dest``."""
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise SandboxError(f"copy_out destination is not an empty directory: {dest}")
    dest.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, _DIR_FLAGS)
    try:
        _copy_tree_out(fd, dest)
    finally:
        os.close(fd)


def _copy_tree_out(dir_fd: int, dest: Path) -> None:
    with os.scandir(dir_fd) as it:
        entries = list(it)
    for entry in entries:
        st = entry.stat(follow_symlinks=False)
        target = dest / entry.name
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(entry.name, dir_fd=dir_fd), target)
        elif stat.S_ISDIR(st.st_mode):
            try:
                sub = os.open(entry.name, _DIR_FLAGS, dir_fd=dir_fd)
            except OSError:
                continue  # vanished or replaced meanwhile
            try:
                target.mkdir()
                _copy_tree_out(sub, target)
                os.chmod(target, stat.S_IMODE(st.st_mode) & 0o777 | 0o700)
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            try:
                fd = _open_regular(dir_fd, entry.name, os.O_RDONLY)
            except (SandboxError, OSError):
                continue
            with os.fdopen(fd, "rb") as inp, open(target, "wb") as out:
                shutil.copyfileobj(inp, out, _CHUNK)
            os.chmod(target, stat.S_IMODE(st.st_mode) & 0o777)
            os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))


def rmtree(path: Path) -> None:
    """Remove a tree the sandbox may have made hard to remove (dirs with mode 000)."""

    def onexc(func, p, exc):
        if isinstance(exc, FileNotFoundError):
            return
        os.chmod(os.path.dirname(p), 0o700)
        if os.path.isdir(p) and not os.path.islink(p):
            os.chmod(p, 0o700)
            _rmtree(p)
        else:
            func(p)

    def _rmtree(p) -> None:
        if sys.version_info >= (3, 12):
            shutil.rmtree(p, onexc=onexc)
        else:
            shutil.rmtree(p, onerror=lambda f, q, ei: onexc(f, q, ei[1]))

    if path.exists() or path.is_symlink():
        _rmtree(path)


# -- host state shared by the backends: lock files, owner processes -------------------------


def _starttime(pid: int) -> str | None:
    """Kernel start time of ``pid`` (guards against pid reuse)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_alive(pid: str) -> bool:
    """Whether process ``pid`` (a string from a file name) may exist (True when unsure)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (ValueError, OSError):
        return True
    return True


def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on ``path`` (created), or None when someone holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd
