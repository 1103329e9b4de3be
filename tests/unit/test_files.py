from __future__ import annotations

import stat
from pathlib import Path

from gatewayd.adapters.files import write_atomic


def test_write_atomic_replaces_the_file_and_leaves_nothing_beside_it(tmp_path: Path) -> None:
    path = tmp_path / "engines.json"
    path.write_bytes(b"old")
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["engines.json"]


def test_write_atomic_sets_the_mode_when_given(tmp_path: Path) -> None:
    path = tmp_path / "settings.json"
    write_atomic(path, b"{}", mode=0o640)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
