"""Write files and folders so that they appear whole or not at all (temp path, then rename).

A rename alone is atomic but not durable: after a power cut the new name can point at a file
whose data never reached the disk. So the temp file (or every file of a temp folder) is fsynced
before the rename, and the parent folder after it, which makes the rename itself persistent.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from gptcore.errors import UserError

AT_FDCWD, RENAME_EXCHANGE = -100, 2  # Linux's <fcntl.h> and <linux/fs.h>
UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)  # no permission, a read-only filesystem


@contextlib.contextmanager
def _writable(path: Path) -> Iterator[None]:
    """Turn a write beside `path` refused for want of permission, or by a read-only filesystem,
    into one line naming it: the user chose a place they cannot write. The atomic writers wrap
    their first write in it, so every command's outputs are covered, whether or not it checked
    its output folder up front (`check_writable_dir`); other errors (a full disk) stay failures."""
    try:
        yield
    except OSError as err:
        if err.errno not in UNWRITABLE:
            raise
        raise UserError(
            f"{path} is not writable ({err.strerror}); give a path on a writable filesystem"
        ) from None


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `path`; on success fsync it, rename it onto `path` and fsync the
    folder; on error remove it."""
    path = Path(path)
    with _writable(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp folder beside `path`; on success its contents are fsynced and it replaces
    `path` (then the parent folder is fsynced); on error it is removed. An existing `path` is
    swapped with the new folder in one step where the system can (Linux), else renamed to
    `.NAME.old` first, which the next call restores if a kill fell between the two renames.
    The folder gets the permissions `mkdir` would give it (mkdtemp's are owner-only), so others
    can read what is shared (a data folder on a cluster, an exported model)."""
    path = Path(path)
    old = path.with_name(f".{path.name}.old")
    with _writable(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        if old.exists() and not path.exists():  # a run killed between the two renames below
            os.replace(old, path)
        tmp = _new_folder(path.parent, f".{path.name}.", ".tmp")
    try:
        yield tmp
        fsync_tree(tmp)
        if not path.exists():
            os.replace(tmp, path)
        elif not _exchange(tmp, path):  # no atomic swap here: two renames, `old` bridging them
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        fsync_path(path.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # after a swap, the previous version


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux's renameat2 with RENAME_EXCHANGE), so that `b`
    names a whole folder at every moment, whatever kills the process; False where the system or
    the filesystem has no such call."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _new_folder(parent: Path, prefix: str, suffix: str) -> Path:
    """A folder with a fresh random name (64 bits), made with mode 0o777 so that the kernel
    applies the umask as for any `mkdir`. Reading the umask would mean setting it, process-wide:
    a file another thread created meanwhile would get umask 0."""
    folder = parent / f"{prefix}{secrets.token_hex(8)}{suffix}"
    folder.mkdir(0o777)
    return folder


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's data and metadata to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root` (folders after their contents), then `root`."""
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(Path(folder, name))
        fsync_path(Path(folder))


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def check_writable_dir(path: str | os.PathLike, name: str) -> None:
    """Refuse, in one line and before any work, a folder path that cannot be written: an
    existing file, a path under a file, a read-only filesystem or a folder without permission.

    It probes with a temp folder in `path` or its nearest existing ancestor, so that it creates
    nothing (not even the missing parents) and a run that fails later leaves no trace."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{name} {path} is an existing file; give a folder path")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{name} {path}: {existing} is a file, not a folder; give another {name}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gptrun-probe-", dir=existing))
    except OSError as err:
        raise UserError(
            f"{name} {path} is not writable ({err.strerror} in {existing}); give a "
            "folder on a writable filesystem"
        ) from None
