"""core/pull: what a pull's source means, which files it picks, what fits on the disk."""

from __future__ import annotations

import pytest

from gatewayd.core.errors import (
    HubFileAmbiguous,
    HubFileNotFound,
    InsufficientStorage,
    ModelSourceInvalid,
)
from gatewayd.core.pull import (
    GIB,
    PullSpec,
    RateMeter,
    RemoteFile,
    RepoListing,
    check_space,
    model_name,
    quant_tags,
    reserve_bytes,
    select,
    valid_name,
)


def listing(*paths: str, repo: str = "org/Model-GGUF") -> RepoListing:
    return RepoListing(repo=repo, commit="c" * 40,
                       files=tuple(RemoteFile(path=p, size=100, sha256="a" * 64)
                                   for p in ("README.md", *paths)))


@pytest.mark.parametrize(("text", "want"), [
    ("org/repo", PullSpec("org/repo")),
    ("org/repo:Q4_K_M", PullSpec("org/repo", quant="Q4_K_M")),
    ("org/repo:sub/Model-Q8_0.gguf", PullSpec("org/repo", file="sub/Model-Q8_0.gguf")),
    ("org/repo@v1.2:q8_0", PullSpec("org/repo", revision="v1.2", quant="q8_0")),
    ("hf://org/repo/Model-Q8_0.gguf", PullSpec("org/repo", file="Model-Q8_0.gguf")),
    ("  org/repo  ", PullSpec("org/repo")),
])
def test_sources_parse(text: str, want: PullSpec) -> None:
    assert PullSpec.parse(text) == want


@pytest.mark.parametrize("text", [
    "", "repo", "/org/repo", "org/repo/extra", "org/repo:../../etc/passwd.gguf",
    "org/repo:/abs.gguf", "org/repo:Q4 K", "../x/y", "org/repo@:Q4_0", "org/re po",
])
def test_bad_sources_are_refused_with_the_forms(text: str) -> None:
    with pytest.raises(ModelSourceInvalid):
        PullSpec.parse(text)


def test_a_spec_prints_as_it_parses() -> None:
    for text in ("org/repo", "org/repo@abc:Q4_K_M", "org/repo:dir/f.gguf"):
        assert str(PullSpec.parse(text)) == text


def test_the_quant_picks_its_file_and_not_a_longer_or_i_quant() -> None:
    files = listing("Model-Q4_K.gguf", "Model-Q4_K_M.gguf", "Model-IQ4_XS.gguf",
                    "Model-Q4_XS.gguf", "Model-Q8_0.gguf")
    assert select(PullSpec.parse("org/Model-GGUF:Q4_K"), files).weights[0].path \
        == "Model-Q4_K.gguf"
    assert select(PullSpec.parse("org/Model-GGUF:q4_k_m"), files).weights[0].path \
        == "Model-Q4_K_M.gguf"
    assert select(PullSpec.parse("org/Model-GGUF:Q4_XS"), files).weights[0].path \
        == "Model-Q4_XS.gguf"


def test_no_quant_takes_the_only_model_else_q4_k_m_else_asks() -> None:
    one = listing("Model-Q8_0.gguf")
    assert select(PullSpec.parse("org/Model-GGUF"), one).name == "Model-Q8_0"
    several = listing("Model-Q4_K_M.gguf", "Model-Q8_0.gguf")
    assert select(PullSpec.parse("org/Model-GGUF"), several).name == "Model-Q4_K_M"
    no_default = listing("Model-Q5_K_M.gguf", "Model-Q8_0.gguf")
    with pytest.raises(HubFileAmbiguous) as e:
        select(PullSpec.parse("org/Model-GGUF"), no_default)
    assert "org/Model-GGUF:Q5_K_M" in e.value.message and "org/Model-GGUF:Q8_0" in e.value.message


def test_a_missing_quant_lists_what_there_is() -> None:
    with pytest.raises(HubFileNotFound) as e:
        select(PullSpec.parse("org/Model-GGUF:Q2_K"), listing("Model-Q8_0.gguf", "Model-F16.gguf"))
    assert "Q8_0" in e.value.message and "F16" in e.value.message


def test_a_repository_without_gguf_is_not_a_model_source() -> None:
    with pytest.raises(HubFileNotFound):
        select(PullSpec.parse("org/x"), listing("model.safetensors"))


def test_split_models_come_whole_in_order_and_incomplete_ones_not_at_all() -> None:
    files = listing("Q8_0/Big-Q8_0-00002-of-00003.gguf", "Q8_0/Big-Q8_0-00001-of-00003.gguf",
                    "Q8_0/Big-Q8_0-00003-of-00003.gguf", "Big-Q4_K_M-00001-of-00002.gguf")
    chosen = select(PullSpec.parse("org/Big:Q8_0"), files)
    assert [f.path for f in chosen.weights] == [
        f"Q8_0/Big-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert chosen.name == "Big-Q8_0"
    with pytest.raises(HubFileNotFound):   # its second part is missing
        select(PullSpec.parse("org/Big:Q4_K_M"), files)
    by_file = select(PullSpec.parse("org/Big:Q8_0/Big-Q8_0-00002-of-00003.gguf"), files)
    assert len(by_file.weights) == 3


def test_the_projector_comes_only_when_asked_and_prefers_f16() -> None:
    files = listing("Model-Q4_K_M.gguf", "mmproj-Model-Q8_0.gguf", "mmproj-Model-F16.gguf")
    assert select(PullSpec.parse("org/M:Q4_K_M"), files).mmproj is None
    chosen = select(PullSpec.parse("org/M:Q4_K_M"), files, mmproj=True)
    assert chosen.mmproj is not None and chosen.mmproj.path == "mmproj-Model-F16.gguf"
    assert chosen.total_bytes == 200
    with pytest.raises(HubFileNotFound):
        select(PullSpec.parse("org/M"), listing("Model-Q4_K_M.gguf"), mmproj=True)


def test_names_are_one_safe_folder() -> None:
    assert model_name("dir/Qwen2.5-7B-Instruct-Q4_K_M.gguf") == "Qwen2.5-7B-Instruct-Q4_K_M"
    assert model_name("a b+c.gguf") == "a-b-c"
    assert valid_name("mine_1.5") == "mine_1.5"
    for bad in (".hidden", "a/b", "..", "x y", ""):
        with pytest.raises(ModelSourceInvalid):
            valid_name(bad)


def test_quant_tags_read_from_names() -> None:
    assert quant_tags(["M-Q4_K_M.gguf", "M.IQ2_XXS.gguf", "M-bf16.gguf", "README.md"]) == [
        "Q4_K_M", "IQ2_XXS", "BF16"]


def test_space_is_checked_with_a_reserve_that_shrinks_on_small_disks() -> None:
    assert reserve_bytes(10_000 * GIB) == GIB
    assert reserve_bytes(20 * 1024 * 1024) == 1024 * 1024
    check_space("/m", need=GIB, free=3 * GIB, filesystem=100 * GIB)
    with pytest.raises(InsufficientStorage) as e:
        check_space("/m", need=GIB, free=int(1.5 * GIB), filesystem=100 * GIB)
    assert "/m has 1.5 GiB free" in e.value.message and "1.0 GiB" in e.value.message
    assert e.value.status == 507 and e.value.extra["need_bytes"] == GIB


def test_the_rate_is_over_a_window() -> None:
    meter = RateMeter(window=5.0)
    assert meter.rate() is None
    for t in range(11):
        meter.add(float(t), t * 100 if t < 6 else 500 + (t - 5) * 1000)
    rate = meter.rate()
    assert rate is not None and 900 <= rate <= 1000
