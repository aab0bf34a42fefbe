"""Safe file handling on a shared machine: atomic writes, exclusive temporaries, private dirs.

Everything ringmpi writes goes to a temporary file first, created exclusively
(``O_CREAT | O_EXCL | O_NOFOLLOW``, a random name) in the target's directory, so a
name planted by another user (a symlink to someone's file) is never opened or
truncated. The temporary is flushed to stable storage and renamed into place; the
directory is then flushed too, so the rename survives a crash of the node.

Caches of code (compiled kernels) live in *private* directories: owned by the
user, not writable by group or others (:func:`open_private_dir`); files in them are
opened relative to the directory's descriptor with ``O_NOFOLLOW`` and checked the
same way (:func:`open_private_file`).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
import zlib

__all__ = [
    "UnsafePathError",
    "fsync_path",
    "write_json",
    "replace_with",
    "exclusive_temp",
    "umask",
    "check_owned",
    "open_private_dir",
    "open_private_file",
    "write_private",
    "sha256_fd",
]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


class UnsafePathError(PermissionError):
    """A file or directory another user could have planted or could change."""


def fsync_path(path: str) -> None:
    """Flush a file or directory to stable storage."""
    fd = os.open(path, os.O_RDONLY | _CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask() -> int:
    """The process umask, read without changing it where /proc allows."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def exclusive_temp(target: str, mode: int = 0o666) -> tuple[int, str]:
    """Create a new temporary file next to ``target``; (fd, path).

    The name is ``.<basename>.<random>.tmp`` in the target's directory, created with
    ``O_CREAT | O_EXCL | O_NOFOLLOW``: an existing name (a planted symlink) is never
    opened. Its permissions are ``mode`` less the umask, like an ordinary new file.

    Parameters
    ----------
    target : str
        The final name the temporary will be renamed to.
    mode : int
        Permission bits before the umask.
    """
    target = os.fspath(target)
    d, base = os.path.split(os.path.abspath(target))
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    for _ in range(100):
        tmp = os.path.join(d, f".{base}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, mode & ~umask()), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"{d}: no free temporary name for {base}")


def replace_with(path: str, data, *, sync: bool = True, direct: bool = False) -> int:
    """Write ``data`` (str, bytes, or a list of bytes-like pieces written one after
    another) to an exclusive temporary beside ``path``, fsync, rename; the CRC32 of the
    bytes written.

    The temporary is removed if anything fails, so ``path`` holds the old file or the
    whole new one, never a part. ``sync=False``: no fsync; the kernel is only asked to
    start writing the pages out (``POSIX_FADV_DONTNEED``), so that a later
    :func:`fsync_path` of ``path`` finds little left to wait for. ``direct=True``: a
    megabyte or more goes out by ``O_DIRECT`` (:mod:`ringmpi.runtime.direct_io`) where the file
    system takes it, without the page cache's CPU time; the same bytes either way.
    """
    from . import direct_io

    fd, tmp = exclusive_temp(path)
    try:
        with os.fdopen(fd, "w" if isinstance(data, str) else "wb") as fh:
            pieces = data if isinstance(data, list) else [data]
            crc = None
            if direct and not isinstance(data, str) and direct_io.enabled():
                total = sum(memoryview(p).nbytes for p in pieces)
                if total >= direct_io.MIN_BYTES and direct_io.set_direct(fd):
                    try:
                        crc = direct_io.write_pieces(fd, pieces)[1]
                    except direct_io.DirectUnsupported:  # refused after all: start again
                        direct_io.set_direct(fd, False)
                        os.ftruncate(fd, 0)
            if crc is None:
                crc = 0
                for piece in pieces:
                    fh.write(piece)
                    crc = zlib.crc32(piece.encode() if isinstance(piece, str) else piece, crc)
                fh.flush()
            if sync:
                os.fsync(fh.fileno())
            elif hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        os.replace(tmp, path)
        return crc
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: str, obj, *, indent: int = 1, sync: bool = True) -> None:
    """Write ``obj`` as JSON (sorted keys) to an exclusive temporary, fsync, rename, fsync dir.

    ``sync=False``: neither fsync (as :func:`replace_with`); the caller syncs later.
    """
    path = os.fspath(path)
    replace_with(path, json.dumps(obj, indent=indent, sort_keys=True) + "\n", sync=sync)
    if sync:
        fsync_path(os.path.dirname(os.path.abspath(path)))


def check_owned(st: os.stat_result, what: str, hint: str = "") -> None:
    """Raise :class:`UnsafePathError` unless ``st`` is owned by us and not group/other-writable.

    Parameters
    ----------
    st : os.stat_result
        The status of the opened file or directory (``os.fstat``).
    what : str
        Its name, for the message.
    hint : str
        What the user can do about it, appended to the message.
    """
    uid = os.geteuid()
    why = None
    if st.st_uid != uid:
        why = f"owned by uid {st.st_uid}, not by this user (uid {uid})"
    elif st.st_mode & 0o022:
        why = f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    if why:
        raise UnsafePathError(f"{what}: {why}: refusing to use it" + (f"; {hint}" if hint else ""))


def open_private_dir(path: str, create: bool = True, hint: str = "") -> int:
    """Open (and with ``create`` make, mode 0700) a directory only this user can change; its fd.

    A symlink as the last component is followed only when this user owns it; the
    directory itself must be owned by this user and not writable by group or others.

    Parameters
    ----------
    path : str
        The directory.
    create : bool
        Create it (and missing parents) when absent; new directories are mode 0700.
    hint : str
        Advice appended to the error message.

    Raises
    ------
    UnsafePathError
        The directory (or the symlink naming it) belongs to another user or is
        writable by group or others.
    """
    path = os.fspath(path)
    if create:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        lst = os.lstat(path)
    except FileNotFoundError:
        raise
    if stat.S_ISLNK(lst.st_mode) and lst.st_uid != os.geteuid():
        raise UnsafePathError(
            f"{path}: a symlink owned by uid {lst.st_uid}: refusing to use it"
            + (f"; {hint}" if hint else "")
        )
    fd = os.open(path, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    try:
        check_owned(os.fstat(fd), path, hint)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private_file(dirfd: int, name: str, what: str, flags: int = os.O_RDONLY) -> int:
    """Open regular file ``name`` in directory ``dirfd`` without following a symlink; its fd.

    Raises :class:`UnsafePathError` if it is not a regular file owned by this user
    and unwritable by group/others; ``FileNotFoundError`` if it is absent.
    """
    try:
        fd = os.open(name, flags | _NOFOLLOW | _CLOEXEC, 0o600, dir_fd=dirfd)
    except OSError as exc:
        if _NOFOLLOW and exc.errno == 40:  # ELOOP: the name is a symlink
            raise UnsafePathError(f"{what}: a symlink: refusing to follow it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{what}: not a regular file: refusing to use it")
        check_owned(st, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(dirfd: int, name: str, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` as ``name`` in directory ``dirfd`` (exclusive temporary, fsync, rename)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, flags, mode, dir_fd=dirfd)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dirfd)
        except OSError:
            pass
        raise


def sha256_fd(fd: int) -> str:
    """Hex SHA-256 of everything readable from ``fd`` (read from offset 0 with pread)."""
    h, off = hashlib.sha256(), 0
    while True:
        chunk = os.pread(fd, 1 << 20, off)
        if not chunk:
            return h.hexdigest()
        h.update(chunk)
        off += len(chunk)
