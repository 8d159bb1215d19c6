"""write_atomic: a file is replaced whole or not at all, and no temporary file outlives the write."""

from __future__ import annotations

import pytest

from blockspec.files import write_atomic


def test_write_atomic_creates_then_replaces_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "probe.json"
    write_atomic(path, '{"a": 1}\n')
    write_atomic(path, '{"a": 2}\n')
    assert path.read_text() == '{"a": 2}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["probe.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary_one(tmp_path):
    path = tmp_path / "probe.json"
    write_atomic(path, "old\n")
    with pytest.raises(UnicodeEncodeError):
        write_atomic(path, "\udc80")  # a lone surrogate: fails inside the write, after the temporary file exists
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["probe.json"]
