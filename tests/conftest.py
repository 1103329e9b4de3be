"""Fixtures shared by every tier; the container plumbing lives in tests/harness."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from gatewayd.adapters.systemd import Systemd
from tests.harness.container import SystemdContainer, why_unavailable
from tests.harness.plugin import (  # noqa: F401 - pytest finds hooks by name here
    IN_CONTAINER,
    REPO,
    engine_binary,
    pytest_collection_modifyitems,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
    unavailable,
)

sys.path.insert(0, str(REPO / "scripts"))
import make_tiny_model
import make_tiny_whisper

TINY_MODEL_NAMES = ("alpha", "beta", "gamma")

# Hypothesis profiles for the property tests (marked `fuzz`; how to run and reproduce them:
# tests/http/test_fuzz.py). "ci", loaded by Hypothesis itself where CI is set (written out
# here so that it does not change with Hypothesis): the same cases every run. "explore",
# chosen with --hypothesis-profile=explore --hypothesis-seed=N: new cases from the seed, at
# each test's exploring budget (a test reads the profile's name: EXPLORING).
settings.register_profile("ci", derandomize=True, database=None, deadline=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", derandomize=False, database=None, deadline=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "fuzz: a property test that searches (Hypothesis): derandomized in CI, "
                   "exploring with --hypothesis-profile=explore --hypothesis-seed=N")


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item
                                  ) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Tests marked asyncio(loop_factories=[...]) run on each loop named ("asyncio",
    "uvloop"): the gateway runs on uvloop where it is installed; the rest of the suite on
    asyncio's own loop."""
    marker = item.get_closest_marker("asyncio")
    if marker is None or "loop_factories" not in marker.kwargs:
        return {"asyncio": asyncio.new_event_loop}
    import uvloop
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def llama_server() -> Path:
    return engine_binary("LLAMA_SERVER")


@pytest.fixture(scope="session")
def whisper_server() -> Path:
    return engine_binary("WHISPER_SERVER")


@pytest.fixture(scope="session")
def llama_cpp_python() -> Path:
    """The python of a venv with llama-cpp-python[server]: `python -m llama_cpp.server`."""
    return engine_binary("LLAMA_CPP_PYTHON")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three real llama-architecture GGUF models; "alpha" has an mmproj beside it."""
    root = tmp_path_factory.mktemp("models")
    models = {}
    for seed, name in enumerate(TINY_MODEL_NAMES):
        path = root / f"tiny-{name}.gguf"
        make_tiny_model.write_model(str(path), name=f"tiny-{name}", seed=seed)
        models[name] = path
    make_tiny_model.write_mmproj(str(root / "mmproj-tiny-alpha.gguf"), "tiny-alpha", seed=0)
    return models


@pytest.fixture(scope="session")
def tiny_loras(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two real LoRA adapters for the tiny models ("sql", "fr": names only): llama-server
    --lora loads them, and each changes the greedy answer its own way."""
    root = tmp_path_factory.mktemp("loras")
    loras = {}
    for seed, name in enumerate(("sql", "fr")):
        loras[name] = root / f"lora-{name}.gguf"
        make_tiny_model.write_lora(str(loras[name]), f"tiny-lora-{name}", seed=seed)
    return loras


@pytest.fixture(scope="session")
def tiny_reranker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real qwen3-architecture reranker (rank pooling in its header, a classifier
    head): llama-server --rerank scores documents with it."""
    path = tmp_path_factory.mktemp("reranker") / "tiny-rerank.gguf"
    make_tiny_model.write_model(str(path), name="tiny-rerank", seed=7, reranker=True)
    return path


@pytest.fixture(scope="session")
def slow_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wider, deeper tiny llama (~35 MB): ~450 tokens/s on one thread, so a 2000-token
    stream lasts seconds. For tests that need an engine busy while other things happen."""
    path = tmp_path_factory.mktemp("slow") / "slow.gguf"
    make_tiny_model.write_model(str(path), name="slow", seed=5, n_embd=256, n_layer=8,
                                n_ff=1024, n_head=4, n_head_kv=4)
    return path


@pytest.fixture(scope="session")
def tiny_whisper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("whisper") / "tiny-whisper.bin"
    make_tiny_whisper.build(str(path), seed=0)
    return path


@pytest.fixture
async def systemd() -> AsyncIterator[Systemd]:
    """The container's system manager over the system bus (only inside the container)."""
    if not IN_CONTAINER:
        pytest.fail("the systemd fixture is for tests marked `systemd` (they run inside "
                    "the test container); never talk to the host's own manager")
    sd = await Systemd.connect("system")
    try:
        yield sd
    finally:
        sd.close()


@pytest.fixture
def systemd_container(request: pytest.FixtureRequest) -> Iterator[SystemdContainer]:
    """A fresh container driven from the host (for tests marked `container`)."""
    if IN_CONTAINER:
        pytest.fail("container tests drive a container from the host, not from inside one")
    if reason := why_unavailable():
        unavailable(reason)
    name = f"t{os.getpid()}-{abs(hash(request.node.nodeid)) % 10**6}"
    box = SystemdContainer(name, binds=[REPO])
    box.start()
    try:
        yield box
    finally:
        box.stop()


@pytest.fixture(scope="session")
def fake_nvml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the fake libnvidia-ml.so.1 (tests/harness/fake_nvml.c)."""
    from tests.harness import fake_nvml
    return fake_nvml.build(tmp_path_factory.mktemp("fake-nvml"))
