"""Pack the tour's folder into what a lent GPU machine can hand back: one archive and SUMMARY.md.

The device tool returns at most 8 files from $OUT, each at most 16 MiB (64 MiB together), no deeper
than two folders below it, each name made of letters, digits, '.', '_' and '-' only; anything else
is silently left behind (/work/.library/device/README.md, "Limits"). A tour makes dozens of files,
so they travel as one .tar.gz beside a copy of SUMMARY.md; `returnable_problems` checks a folder
against those rules, so a test can prove that what the tour leaves in $OUT all comes back.
"""

from __future__ import annotations

import os
import re
import shutil
import tarfile
from pathlib import Path

__all__ = ["MAX_FILES", "MAX_FILE_BYTES", "MAX_TOTAL_BYTES", "MAX_DEPTH", "returnable_problems",
           "pack"]

MAX_FILES = 8
MAX_FILE_BYTES = 16 * 2 ** 20
MAX_TOTAL_BYTES = 64 * 2 ** 20
MAX_DEPTH = 2  # folders between $OUT and a file
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def returnable_problems(folder: Path) -> list[str]:
    """What in `folder` would not come back from the device (empty list: all of it would)."""
    problems, files, total = [], 0, 0
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if not all(_NAME.match(part) for part in relative.parts):
            problems.append(f"{relative}: a name with characters other than letters, digits, "
                            f"'.', '_' and '-'")
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            problems.append(f"{relative}: not a plain file or folder")
        elif path.is_file():
            files += 1
            size = path.stat().st_size
            total += size
            if size > MAX_FILE_BYTES:
                problems.append(f"{relative}: {size:,} B > {MAX_FILE_BYTES:,} B")
            if len(relative.parts) - 1 > MAX_DEPTH:
                problems.append(f"{relative}: {len(relative.parts) - 1} folders deep > {MAX_DEPTH}")
    if files > MAX_FILES:
        problems.append(f"{files} files > {MAX_FILES}")
    if total > MAX_TOTAL_BYTES:
        problems.append(f"{total:,} B in all > {MAX_TOTAL_BYTES:,} B")
    return problems


def _write_archive(out: Path, archive: Path, leave_out: set[Path]) -> None:
    partial = archive.with_name(archive.name + ".part")
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(out, arcname=out.name, filter=lambda info: None if
                (out.parent / info.name) in leave_out else info)
    os.replace(partial, archive)  # a tour killed mid-write keeps the previous archive whole


def pack(out: Path, dest: Path, summary: str | None = "SUMMARY.md") -> tuple[Path, list[Path]]:
    """Write dest/<out.name>.tar.gz of the whole folder `out`, and copy out/summary (if given)
    into dest beside it.

    If the archive comes out over MAX_FILE_BYTES, the largest files are left out of it one by
    one until it fits. Returns (the archive, the files left out).
    """
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / f"{out.name}.tar.gz"
    by_size = sorted((path for path in out.rglob("*") if path.is_file()),
                     key=lambda path: path.stat().st_size, reverse=True)
    leave_out: set[Path] = set()
    _write_archive(out, archive, leave_out)
    while archive.stat().st_size > MAX_FILE_BYTES and len(leave_out) < len(by_size):
        leave_out.add(by_size[len(leave_out)])
        _write_archive(out, archive, leave_out)
    if summary is not None and (out / summary).is_file():
        shutil.copyfile(out / summary, dest / summary)
    return archive, sorted(leave_out)
