"""The Files source's finished instances: moved to ``done/`` (see :mod:`ackflow.sources.files`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ackflow.sources.files import FilesSource

log = logging.getLogger("ackflow.sources.files")


def move_done(src: FilesSource, items: Sequence[tuple[str, str, tuple[int, ...] | None, str | None]]) -> None:
    """Move finished instances ``(id, name, fingerprint, path)`` (each only if the file
    at ``path`` is still that instance) and their dead letters to ``done/``, never over
    an earlier file; then forget them. A move that fails (EXDEV: ``done/`` on another
    file system; EPERM: a sticky drop folder) is recorded (status ``unmovable`` with
    its cause) and logged, never raised: the file stays and is not read again."""
    moved: list[str] = []
    failed: list[tuple[str, str, str]] = []
    for fid, name, fingerprint, full in items:
        src._move_tried.add(fid)
        target = _free(os.path.join(src.path, "done", name), fid)
        try:
            if full is not None:
                try:
                    same = tuple(_fingerprint(os.stat(full))) == tuple(fingerprint or ())
                except FileNotFoundError:
                    same = False
                if same:
                    os.replace(full, target)
            if os.path.exists(src._dead_path(fid)):
                os.replace(src._dead_path(fid), _free(target, fid, ".dead.jsonl"))
        except OSError as e:
            failed.append((fid, name, f"{type(e).__name__}: {e}"))
        else:
            moved.append(fid)
    with src.states.tx():
        src.states.delete(moved)
        for fid, _, cause in failed:
            src.states.set_status(fid, "unmovable", cause)
        src.states.commit_point()
    for fid, name, cause in failed:
        log.error(
            "source %r: %s (%s) is done but cannot be moved to done/ (%s); it is "
            "left in place and not read again; move or delete it by hand",
            src.name,
            name,
            fid,
            cause,
        )
    if failed or src._unmovable[0]:
        src._count_unmovable()


def _free(path: str, fid: str, suffix: str = "") -> str:
    """``path + suffix`` if nothing is there, else ``path.<fid> + suffix`` (``done/``
    never overwrites)."""
    return path + suffix if not os.path.exists(path + suffix) else f"{path}.{fid}{suffix}"


def _fingerprint(st: os.stat_result) -> list[int]:
    """What tells two files of one name apart: device, inode, size, mtime (ns); the
    ctime is checked besides (see :meth:`FilesSource._instance`). A file is complete
    when it is renamed in, so these do not change while it is read."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
