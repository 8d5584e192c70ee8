"""What a lent GPU machine hands back from $OUT, and the tour's pack that fits it.

The device returns at most 8 files, each at most 16 MiB, no deeper than two folders, named in
letters, digits, '.', '_' and '-' only; `returnable_problems` is that rule, and `pack` leaves a
folder of any shape as one archive plus SUMMARY.md.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

from kvlab.tools.tour import packing
from kvlab.tools.tour.packing import MAX_FILE_BYTES, pack, returnable_problems


def touch(path: Path, size: int = 10) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as file:
        file.truncate(size)  # sparse: a 17 MiB file costs no disk
    return path


def test_what_the_device_would_leave_behind(tmp_path):
    ok = tmp_path / "ok"
    touch(ok / "SUMMARY.md")
    touch(ok / "a" / "b" / "two-folders_down.tar.gz")
    assert returnable_problems(ok) == []

    bad = tmp_path / "bad"
    touch(bad / "tests" / "cuda tests.log")                 # a space
    touch(bad / "a" / "b" / "c" / "three.txt")              # three folders down
    touch(bad / "big.bin", MAX_FILE_BYTES + 1)             # over 16 MiB
    os.symlink(bad / "big.bin", bad / "link")              # not a plain file
    problems = returnable_problems(bad)
    assert any("cuda tests.log" in p and "characters" in p for p in problems)
    assert any("three.txt" in p and "3 folders deep" in p for p in problems)
    assert any("big.bin" in p and f"{MAX_FILE_BYTES + 1:,} B" in p for p in problems)
    assert any(p.startswith("link: not a plain file") for p in problems)

    many = tmp_path / "many"
    for i in range(9):
        touch(many / f"f{i}.md")
    assert returnable_problems(many) == ["9 files > 8"]


def test_a_tour_folder_packs_into_two_returnable_files(tmp_path):
    out = tmp_path / "work" / "gpu-tour-2026-12-02-0400"
    for i in range(40):  # the dozens of files a tour makes, some deep, one with a space
        touch(out / "notebooks" / "deep" / "er" / f"cell_{i}.png", 1000)
    touch(out / "tests" / "cuda tests.log")
    (out / "SUMMARY.md").write_text("# kvlab GPU tour\n")
    assert returnable_problems(out)  # as it is, it would not come back
    dest = tmp_path / "OUT"
    archive, left_out = pack(out, dest)
    assert left_out == [] and archive == dest / "gpu-tour-2026-12-02-0400.tar.gz"
    assert sorted(path.name for path in dest.iterdir()) == \
        ["SUMMARY.md", "gpu-tour-2026-12-02-0400.tar.gz"]
    assert returnable_problems(dest) == []
    with tarfile.open(archive) as tar:
        assert len([m for m in tar.getmembers() if m.isfile()]) == 42
    # Packing again (after the next stage) replaces the archive: still two files.
    touch(out / "more.json")
    pack(out, dest)
    assert len(list(dest.iterdir())) == 2


def test_an_archive_over_the_limit_leaves_the_largest_files_out(tmp_path, monkeypatch):
    out = tmp_path / "tour"
    (out / "big.bin").parent.mkdir(parents=True)
    (out / "big.bin").write_bytes(os.urandom(200_000))   # random bytes do not compress
    (out / "small.md").write_text("figures\n")
    monkeypatch.setattr(packing, "MAX_FILE_BYTES", 50_000)
    archive, left_out = pack(out, tmp_path / "OUT", summary=None)
    assert left_out == [out / "big.bin"] and archive.stat().st_size <= 50_000
    with tarfile.open(archive) as tar:
        assert "tour/small.md" in tar.getnames() and "tour/big.bin" not in tar.getnames()
