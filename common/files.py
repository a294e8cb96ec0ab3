"""Files that are either wholly old or wholly new after a kill at any moment, and their checksums."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Write `path` through `write(handle)` into a hidden temporary file beside it, fsync, then rename over
    `path`: a reader sees the old content or the new, never a torn mix. A write that fails (a full disk) removes
    its temporary file on the way out."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with open(temporary, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
        sync_directory(path.parent)  # the rename itself survives a power loss only once its directory is synced
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda handle: handle.write(text.encode("utf-8")))


def sync_directory(path: str | Path) -> None:
    """fsync a directory, so that the names created, renamed or removed in it are on storage. A file system that
    cannot sync (EINVAL: some FUSE and network mounts) makes each operation durable itself, or nothing can; a real I/O
    error is raised."""
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fsync_if_supported(descriptor)
    finally:
        os.close(descriptor)


def fsync_if_supported(descriptor: int) -> None:
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise


def sync_tree(root: str | Path, files: bool = False) -> None:
    """fsync `root` and every directory under it, deepest first (and, with `files`, every file first): a staging
    tree's contents before it is renamed into place and vouched for."""
    root = Path(root)
    below = list(root.rglob("*"))
    for path in below if files else []:
        if path.is_file():
            with open(path, "rb") as handle:
                fsync_if_supported(handle.fileno())
    directories = [path for path in below if path.is_dir()]
    for directory in sorted(directories, key=lambda path: len(path.parts), reverse=True) + [root]:
        sync_directory(directory)


def replace_directory(staging: Path, target: Path) -> None:
    """Put the complete tree `staging` at `target`. One already there is renamed aside (`replaced_aside`) first and
    deleted after, so a kill at any moment leaves the old tree or the new one under `target`'s name, never one half
    deleted (removing a 70B checkpoint's ~830 GB takes minutes); killed between the two renames, the old one waits
    aside for `restore_replaced`."""
    aside = replaced_aside(target)
    if target.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(target, aside)
    os.replace(staging, target)
    sync_directory(target.parent)
    shutil.rmtree(aside, ignore_errors=True)


def tree_bytes(directory: Path) -> int:
    """The bytes of the files under `directory` (what removing it frees)."""
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def replaced_aside(target: Path) -> Path:
    return target.with_name(f".{target.name}.replaced")


def restore_replaced(aside: Path, whole: Callable[[Path], bool] = lambda path: True) -> tuple[Path, int, bool]:
    """What a replacement killed between its renames left at `aside`: put back where it was when nothing took its
    place and it is `whole` (a deletion that failed part-way leaves one that is not), else removed. Returns the
    path it has now, its bytes, and whether it was put back."""
    target = aside.with_name(aside.name.removeprefix(".").removesuffix(".replaced"))
    size = tree_bytes(aside)
    if not target.exists() and whole(aside):
        os.replace(aside, target)
        return target, size, True
    shutil.rmtree(aside, ignore_errors=True)
    return aside, size, False


def unused_name(path: Path) -> Path:
    """`path`, or `path-2`, `path-3`, ...: the first that does not exist (for copies set aside, never replaced)."""
    candidate, number = path, 1
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}-{number}")
    return candidate


def sha256_of(path: str | Path, chunk_bytes: int = 1 << 24, sync: bool = False) -> str:
    """The file's sha256; with `sync`, its written pages are flushed to storage first (fsync works on a descriptor
    opened for reading), so that what the checksum vouches for is what a power loss leaves."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        if sync:
            fsync_if_supported(handle.fileno())
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


# A file's fingerprint reads 8 blocks of 16 KiB spread evenly over it (the first and the last included): 128 KiB per
# file whatever its size, so that every start of a preprocessing or a training run can afford it on terabytes. It
# sees a file replaced, shuffled, truncated, grown or still being copied; an edit confined to the unsampled middle
# that keeps the size is the one change it can miss.
FINGERPRINT_BLOCKS = 8
FINGERPRINT_BLOCK_BYTES = 16 * 1024


def fingerprint(path: str | Path) -> dict[str, int | str]:
    """{"bytes": size, "sample_sha256": hash of the sampled blocks}; equal fingerprints mean the same content, up to
    the limit above."""
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        if size <= FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK_BYTES:
            digest.update(handle.read())
        else:
            for block in range(FINGERPRINT_BLOCKS):
                handle.seek((size - FINGERPRINT_BLOCK_BYTES) * block // (FINGERPRINT_BLOCKS - 1))
                digest.update(handle.read(FINGERPRINT_BLOCK_BYTES))
    return {"bytes": size, "sample_sha256": digest.hexdigest()}


def fingerprint_change(path: str | Path, before: dict) -> str | None:
    """How `path` differs from its recorded fingerprint, in words; None when it matches."""
    try:
        now = fingerprint(path)
    except OSError as error:
        return f"it cannot be read now ({error.strerror})"
    if now["bytes"] != before["bytes"]:
        return f"its size was {before['bytes']:,} bytes and is {now['bytes']:,} now"
    if now["sample_sha256"] != before["sample_sha256"]:
        return f"its content changed (same size, {before['bytes']:,} bytes)"
    return None


def directory_problem(path: str | Path) -> str | None:
    """Why `path` cannot be (or become) a directory this process writes into, as the rest of a sentence that starts
    with the path; None when it can. Checked before any work: a file in the way or a read-only place was a traceback
    from `mkdir` once the work was done."""
    path = Path(path).absolute()
    if path.exists() and not path.is_dir():
        return "is a file; choose a directory (it is created)"
    in_the_way = next((parent for parent in path.parents if parent.exists() and not parent.is_dir()), None)
    if in_the_way is not None:
        return f"cannot be created: {in_the_way} is a file"
    existing = next(parent for parent in (path, *path.parents) if parent.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot be created or written: this user cannot write {existing} (or it is read-only)"
    return None


def under_a_local_directory(name: str) -> bool:
    """`first/rest` whose `first` is a directory here: a local path (mistyped, or not there yet), even though it is
    also written like a hub name `org/name`. A hub name's organisation is not a directory in the working directory."""
    first = name.split("/", 1)[0]
    return bool(first) and "/" in name and Path(first).expanduser().is_dir()
