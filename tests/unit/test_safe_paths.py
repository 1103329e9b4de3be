"""Every value from outside that becomes a path passes core/safe_paths: driven here with
hostile strings (dot segments, absolute paths, NUL, newlines, unicode look-alikes of '/'
and '.', very long ones), through each function that forms a path from one, and checked
on a real folder: nothing lands or is removed outside its root."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatewayd.core.catalog import Catalog
from gatewayd.core.engine_units import engine_instance
from gatewayd.core.errors import ModelSourceInvalid, UnsafePath
from gatewayd.core.pull import PullSpec, RemoteFile, model_name, valid_name
from gatewayd.core.safe_paths import digest, inside, is_part, path_part, relative_parts
from gatewayd.service.pull_folder import PULL_DIR
from gatewayd.service.pulls import Puller

pytestmark = pytest.mark.fuzz

HOSTILE = [
    "", ".", "..", "../x", "../../somewhere/x", "/etc/passwd", "/", "a/../../b", "a/b",
    "a\x00b", "a\n", "\nb", "x.gguf\n", " a", "a\\..\\b", ".hidden", "...",
    "a\u2215b", "\uff0e\uff0e", "\u2024\u2024", "\uff0fetc", "a\u200bb", "\u0430dmin",
    "a" * 256, "b" * 4096, "~", "~root", "$HOME", "%2e%2e", "..%2f..", "a:b", "*", "?",
    "0" * 63, "0" * 65, "G" * 64, "/" + "0" * 63,
]
hostile = st.one_of(
    st.sampled_from(HOSTILE),
    st.text(max_size=300),
    st.lists(st.sampled_from(["..", ".", "/", "a", "\x00", "\n", "\u2215", "\uff0e", "x.gguf",
                              "0" * 64]), max_size=8).map("".join),
)
SLOW = settings(max_examples=200, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def below(root: Path, path: Path) -> bool:
    return os.path.commonpath([root.resolve(), path.resolve()]) == str(root.resolve()) \
        and path.resolve() != root.resolve()


@SLOW
@given(value=hostile)
def test_a_part_is_one_component_below_its_root_or_refused(tmp_path: Path, value: str) -> None:
    root = tmp_path / "root"
    try:
        part = path_part(value, what="a name")
    except UnsafePath as e:
        assert e.status == 400 and "cannot name a file" in e.message
        assert not is_part(value)
        return
    assert part == value and is_part(value)     # accepted as given, never rewritten
    assert "/" not in part and "\x00" not in part and part.isascii()
    assert part not in (".", "..") and not part.startswith(".")
    assert below(root, inside(root, part, what="a name"))


@SLOW
@given(value=hostile)
def test_a_relative_hub_path_stays_below_its_root_or_is_refused(tmp_path: Path,
                                                                 value: str) -> None:
    try:
        parts = relative_parts(value, what="a hub's path")
    except UnsafePath:
        return
    assert all(is_part(p) for p in parts)
    assert below(tmp_path, tmp_path.joinpath(*parts))


@SLOW
@given(value=hostile)
def test_a_hash_is_hex_of_a_hash_length_or_refused(value: str) -> None:
    try:
        hexed = digest(value, what="a hash")
    except UnsafePath:
        return
    assert len(hexed) in (40, 64) and set(hexed) <= set("0123456789abcdef")


@SLOW
@given(path=hostile, sha=st.one_of(st.none(), hostile), blob=st.one_of(st.none(), hostile))
def test_a_hub_listing_entry_names_only_safe_files(tmp_path: Path, path: str,
                                                   sha: str | None, blob: str | None) -> None:
    """What a pull makes a path of: the file's name (models_dir/NAME/<name>) and its hash
    (.pull/blobs/<hash>.part)."""
    try:
        f = RemoteFile(path=path, size=1, sha256=sha, git_sha1=blob)
    except UnsafePath:
        return
    assert is_part(f.name)
    for key in (f.sha256, f.git_sha1):
        if key is not None:
            assert below(tmp_path, inside(tmp_path, f"{key}.part", what="a hash"))


@SLOW
@given(value=hostile)
def test_names_a_caller_chooses_or_a_hub_suggests_are_safe(value: str) -> None:
    assert is_part(model_name(value))   # made from a hub's file path: always one part
    with contextlib.suppress(ModelSourceInvalid):
        assert is_part(valid_name(value))
    try:
        spec = PullSpec.parse(value)
    except ModelSourceInvalid:
        return
    assert "\n" not in str(spec) and "\x00" not in str(spec) and ".." not in str(spec)


@SLOW
@given(value=hostile)
def test_an_engines_instance_name_is_one_folder(tmp_path: Path, value: str) -> None:
    """/run/llm-engine-<instance>/ and kv-cache/<instance>/ are made of it."""
    if not value:
        return
    instance = engine_instance(value)
    assert "/" not in instance and "\x00" not in instance and instance not in (".", "..")
    assert below(tmp_path, tmp_path / instance)


def sandbox(tmp_path: Path) -> tuple[Path, list[Path]]:
    """models_dir with a pull's folder, and files and folders beside and above it that a
    path escaping models_dir would reach: (models_dir, the sentinels)."""
    models = tmp_path / "models"
    (models / PULL_DIR / "blobs").mkdir(parents=True)
    sentinels = []
    for where in (tmp_path / "somewhere", tmp_path, models, models / PULL_DIR):
        where.mkdir(exist_ok=True)
        (where / "x").mkdir(exist_ok=True)
        for name in ("x.json", "x.part", "victim.part"):
            (where / name).write_text("keep")
            sentinels.append(where / name)
        sentinels.append(where / "x")
    return models, sentinels


async def _no_rescan() -> None:
    return None


class _NoHub:
    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the hub was asked for {name}")


@SLOW
@given(name=hostile)
def test_removing_an_unfinished_pull_by_any_name_touches_nothing_outside(
        tmp_path_factory: pytest.TempPathFactory, name: str) -> None:
    """rm NAME of a name that is not a model: the pull records of that name, nothing else
    (issue 50: '../../somewhere/x' removed a folder and a .json outside models_dir)."""
    models, sentinels = sandbox(tmp_path_factory.mktemp("rm"))
    puller = Puller(hub=_NoHub(), models_dir=lambda: models,  # type: ignore[arg-type]
                    catalog=Catalog([], {}), rescan=_no_rescan, publish=lambda _: None)
    removed = puller.discard_unfinished(name)
    assert not removed or is_part(name)
    inside_pull = {models / PULL_DIR / "x.json", models / PULL_DIR / "x"}
    for s in sentinels:
        assert s.exists() or (name == "x" and s in inside_pull), s


def test_a_pull_record_that_names_parts_outside_blobs_deletes_none_of_them(
        tmp_path: Path) -> None:
    """A record is read back from disk (the gateway's, in a folder its user can write):
    its part names pass the same check."""
    models, sentinels = sandbox(tmp_path)
    (models / PULL_DIR / "y.json").write_text(
        '{"parts": ["../x.part", "/' + str(tmp_path).lstrip("/") + '/x.part", "../../x.part",'
        ' "..", "victim.part"]}')
    (models / PULL_DIR / "blobs" / "victim.part").write_text("mine")
    puller = Puller(hub=_NoHub(), models_dir=lambda: models,  # type: ignore[arg-type]
                    catalog=Catalog([], {}), rescan=_no_rescan, publish=lambda _: None)
    assert puller.discard_unfinished("y")
    assert not (models / PULL_DIR / "blobs" / "victim.part").exists()   # its own part: gone
    assert all(s.exists() for s in sentinels)


def test_the_one_function_refuses_with_a_clear_400() -> None:
    with pytest.raises(UnsafePath) as e:
        path_part("../../etc", what="a model's name")
    assert e.value.status == 400 and e.value.code == "unsafe_path"
    assert "a model's name '../../etc' cannot name a file here" in e.value.message
