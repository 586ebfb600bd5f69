"""Atomic files: the target is the old file or the new one, never half of either."""

import json
import os
import stat

import pytest

from loka_torchrec.atomic_files import atomic_file, write_json_atomic, write_text_atomic


def test_text_and_json_land_whole_and_readable_by_all(tmp_path):
    target = tmp_path / "sub" / "a.json"
    write_json_atomic(target, {"x": 1.5}, fsync=True)
    assert json.loads(target.read_text()) == {"x": 1.5}
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o644
    write_text_atomic(target, "replaced")
    assert target.read_text() == "replaced" and os.listdir(target.parent) == ["a.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "a.txt"
    write_text_atomic(target, "old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_file(target) as f:
            f.write("half")
            raise RuntimeError("boom")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["a.txt"]
    with pytest.raises(ValueError, match="mode"):
        with atomic_file(target, "a"):
            pass
