"""Files corelib reads from places it does not control, and files it writes where someone else may have been first.

Reading (a checkpoint's JSON and templates, a dataset): only a regular file, opened without
blocking (a FIFO or a device would hold the process in ``open`` or ``read`` forever, and
``/dev/zero`` never ends), at most ``limit`` bytes, and JSON no deeper than :data:`MAX_JSON_DEPTH`
(Python's parser raises RecursionError on a deep one, and its integers stop at 4300 digits).
Every failure is one :class:`~corelib.errors.ConfigError` naming the file.

Writing (the run directory's files): never through a symlink or into a FIFO planted under the
name; a whole file is written beside its name (created afresh, ``O_EXCL``) and renamed into
place, so a reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

from corelib.errors import ConfigError, CorelibError

MAX_JSON_DEPTH = 64  # far beyond any config.json or dataset line; far below Python's recursion limit
JSON_LIMIT = 64 << 20  # a config.json, generation_config.json or tokenizer_config.json
TEXT_LIMIT = 16 << 20  # a chat template


class RunDirError(CorelibError):
    """A file of the run directory could not be written (a full disk, a read-only directory, a symlink or a FIFO
    planted under its name)."""


def kind_of(mode: int) -> str:
    kinds = [(stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"),
             (stat.S_ISREG, "a file")]
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def read_bytes(path: Path, what: str, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (symlinks to one are fine); else a ConfigError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{what}: {path} cannot be read: no such file") from None
    except OSError as error:
        raise ConfigError(f"{what}: {path} cannot be opened: {error.strerror or error}") from None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise ConfigError(f"{what}: {path} is {kind_of(status.st_mode)}, not a regular file")
        if status.st_size > limit:
            raise ConfigError(f"{what}: {path} has {status.st_size} bytes, more than the {limit} this file may have")
        with os.fdopen(os.dup(fd), "rb") as file:
            data = file.read(limit + 1)
    except OSError as error:
        raise ConfigError(f"{what}: {path} cannot be read: {error.strerror or error}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ConfigError(f"{what}: {path} grew beyond the {limit} bytes this file may have while it was read")
    return data


def read_text(path: Path, what: str, limit: int = TEXT_LIMIT) -> str:
    try:
        return read_bytes(path, what, limit).decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{what}: {path} is not UTF-8 text ({error.reason} at byte {error.start})") from None


def parse_json(text: str | bytes, where: str) -> Any:
    """``json.loads``, with every way it can fail (and nesting beyond :data:`MAX_JSON_DEPTH`) as ValueError."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        at = f"line {error.lineno} column {error.colno}"
        raise ValueError(f"{where} is not valid JSON ({error.msg} at {at})") from None
    except RecursionError:
        raise ValueError(f"{where} is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as error:  # an integer of more than 4300 digits, among others
        raise ValueError(f"{where} cannot be read as JSON: {' '.join(str(error).split())}") from None
    if json_depth(data) > MAX_JSON_DEPTH:
        raise ValueError(f"{where} is nested deeper than {MAX_JSON_DEPTH} levels")
    return data


def json_depth(data: object) -> int:
    """How deeply lists and objects nest in ``data`` (a scalar: 0), without recursion."""
    deepest = 0
    stack: list[tuple[object, int]] = [(data, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: list[object] = list(node.values())
        elif isinstance(node, list):
            children = list(node)
        else:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > MAX_JSON_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def read_json(path: Path, what: str, limit: int = JSON_LIMIT) -> Any:
    try:
        return parse_json(read_bytes(path, what, limit), f"{what}: {path}")
    except ValueError as error:
        raise ConfigError(str(error)) from None


def write_failed(path: Path, error: OSError, kept: str = "") -> RunDirError:
    code = errno.errorcode.get(error.errno or 0, str(error.errno))
    if error.errno == errno.ELOOP:
        return RunDirError(f"cannot write {path}: it is a symlink; corelib writes its own files only (remove it, or "
                            "choose a new directory with hydra.run.dir=...)")
    if error.errno == errno.ENXIO:
        return RunDirError(f"cannot write {path}: it is a FIFO; corelib writes its own files only")
    return RunDirError(f"cannot write {path}: {error.strerror or error} ({code}){kept}")


def open_for_append(path: Path) -> int:
    """A file descriptor on ``path``, created or emptied, refusing a symlink or anything but a regular file there."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as error:
        raise write_failed(path, error) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise RunDirError(f"cannot write {path}: it is {kind_of(mode)}; corelib writes its own files only")
    os.set_blocking(fd, True)
    return fd


def write_whole(path: Path, text: str) -> Path:
    """Write beside the name (a new file, never through a link), then rename over it: whole or absent, never cut."""
    partial = path.with_name(f".{path.name}.partial")
    try:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()  # a link planted there goes; what it points at stays untouched
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        partial.replace(path)  # renames over a link at ``path`` too: the link goes, its target stays
    except OSError as error:
        with contextlib.suppress(OSError):
            if partial.is_file() and not partial.is_symlink():
                partial.unlink()
        raise write_failed(path, error) from None
    return path


PSEUDO_FILESYSTEMS = ("/proc", "/sys", "/dev")  # the kernel's views: no place for a run's files


def check_directory_for_writing(where: str, key: str) -> None:
    """``where`` can be a run directory: a directory (or one that can be made) that is not a kernel view.

    Hydra would otherwise fail on it with a raw error (FileExistsError on a file or /dev/null,
    "Unable to configure handler" under /proc), after it had already made the directories above it.
    """
    path = Path(os.path.abspath(os.path.expanduser(where)))
    real = Path(os.path.realpath(path))
    for root in PSEUDO_FILESYSTEMS:
        if real == Path(root) or Path(root) in real.parents:
            raise ConfigError(f"{key}={where}: {real} is in {root}, the kernel's view, not a place for a run's files; "
                              f"choose a directory of your own")
    existing = path
    while not os.path.lexists(existing):
        existing = existing.parent
    if not existing.is_dir():
        status = os.stat(existing) if existing.exists() else os.lstat(existing)
        what = "" if existing == path else f" (its part {existing})"
        raise ConfigError(f"{key}={where}{what} is {kind_of(status.st_mode)}, not a directory; choose a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={where}: {existing} is not writable by this user; choose a directory you can write")
