"""Two gateways, each in its own systemd container with its own real llama-server engines,
behind HAProxy with the shipped configuration (packaging/haproxy/haproxy.cfg, only its
addresses changed), as an operator would run them:

- each model's engine runs on one host while the load is light (read from each host's own
  systemd);
- a host stopped mid-load loses no request: every one is answered 200, by the other host
  (with `drain_notice_s`, once the balancer's checks took it out; without, by the balancer
  retrying the connections it refuses);
- started again, it takes its models back.

HAProxy is Debian's, run by this test by its PID. The containers share the host's network
(the gateways listen on loopback ports of their own)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.soak import Spec
from bench.soak_fleet import soak_through
from tests import fleet
from tests.fleet import DEADLINE_S, FleetUnavailable, Host, running_fleet, write_models
from tests.haproxy import free_port, running_haproxy
from tests.harness.plugin import unavailable

pytestmark = [pytest.mark.container, pytest.mark.engine, pytest.mark.slow]

MODELS = ("m-one", "m-two", "m-three", "m-four")
# host 0 stops with a drain notice (the balancer's checks take it out first), host 1
# without one (its refused connections are retried on the other host)
NOTICE_S = (3, 0)
SEEN_503: list[str] = []   # the first 503's headers and body: whose it was
BALANCER_LOG: list[Path] = []   # where this test's HAProxy logs


def status(url: str, body: bytes | None = None) -> int:
    """tests.fleet.status, the first 503's headers and body kept in SEEN_503."""
    return fleet.status(url, body, first_503=SEEN_503)


def chat(model: str) -> bytes:
    return (b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", '
            b'"content": "hi"}]}' % model.encode())


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_models(tmp_path_factory.mktemp("fleet-models"), MODELS)


@pytest.fixture
def hosts(models: Path) -> Iterator[list[Host]]:
    try:
        with running_fleet(models, notice_s=NOTICE_S) as started:
            yield started
    except FleetUnavailable as why:
        unavailable(str(why))


@pytest.fixture
def balancer(hosts: list[Host], tmp_path: Path) -> Iterator[str]:
    front = free_port()
    with running_haproxy(tmp_path, front, [h.port for h in hosts]) as log:
        BALANCER_LOG[:] = [log]
        url = f"http://127.0.0.1:{front}"
        deadline = time.monotonic() + DEADLINE_S
        while status(f"{url}/ready") != 200:
            assert time.monotonic() < deadline, "haproxy never answered"
            time.sleep(0.1)
        yield url


def test_each_model_on_one_host_a_stopped_host_loses_nothing_and_takes_its_models_back(
        hosts: list[Host], balancer: str) -> None:
    url = f"{balancer}/v1/chat/completions"
    for model in MODELS:
        for _ in range(3):
            assert status(url, chat(model)) == 200, model
    placed = [h.engines() for h in hosts]
    assert placed[0] | placed[1] == set(MODELS), placed
    assert not placed[0] & placed[1], \
        f"a model's engine on both hosts: {placed}; haproxy said:\n{balancer_events()}"
    assert placed[0] and placed[1], f"all on one host (the ring's luck?): {placed}"
    home = {m: 0 if m in placed[0] else 1 for m in MODELS}

    # clients on every model while host 0 is stopped: every request answered
    statuses = under_load(url, lambda: hosts[0].box.shell("systemctl stop fleet-gw"))
    assert set(statuses) == {200} and statuses[200] > 20, (statuses, SEEN_503,
                                                           balancer_events())
    moved = [m for m in MODELS if home[m] == 0]
    assert all(m in hosts[1].engines() for m in moved), (moved, hosts[1].engines())

    # host 0 back: the ring sends its models to it again (its engines were kept running
    # across its gateway's stop, and are adopted)
    hosts[0].start_gateway()
    before = {m: hosts[0].answered(m) for m in moved}
    deadline = time.monotonic() + DEADLINE_S
    while not all(hosts[0].answered(m) > before[m] for m in moved):
        for m in moved:
            assert status(url, chat(m)) == 200
        assert time.monotonic() < deadline, "host 0 never took its models back"
        time.sleep(0.2)

    # host 1 stopped with no notice: its listener closes at once, and the connections it
    # refuses are retried on host 0
    statuses = under_load(url, lambda: hosts[1].box.shell("systemctl stop fleet-gw"))
    assert set(statuses) == {200} and statuses[200] > 20, (statuses, SEEN_503,
                                                           balancer_events())


def test_a_hot_model_is_served_by_two_hosts_then_a_soak_has_no_errors(
        hosts: list[Host], balancer: str) -> None:
    """One model hot enough to pass the balance factor: its engine runs on both hosts, every
    request answered. Then bench/soak's clients through HAProxy: see soak_checked."""
    url = f"{balancer}/v1/chat/completions"
    hot = MODELS[0]
    assert status(url, chat(hot)) == 200
    home = [h.engines() for h in hosts]
    assert [hot in e for e in home].count(True) == 1, home
    # long enough to be in flight together when the last arrives (HAProxy counts the
    # requests in flight at each arrival), short enough for 16 at once on 2 busy cores
    body = (b'{"model": "%s", "max_tokens": 48, "ignore_eos": true, "messages": '
            b'[{"role": "user", "content": "hi"}]}' % hot.encode())
    answers: list[int] = []
    threads = [threading.Thread(target=lambda: answers.append(status(url, body)))
               for _ in range(16)]   # (hash-balance-factor 180: past ~10 at once, spills)
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert answers == [200] * 16, (answers, SEEN_503, balancer_events())
    assert all(hot in h.engines() for h in hosts), ([h.engines() for h in hosts],
                                                    balancer_events())
    soak_checked(hosts, balancer)


def soak_checked(hosts: list[Host], balancer: str) -> None:
    """bench/soak's clients through HAProxy (bench/soak --fleet runs it longer, with fewer
    engines than models): every request answered, no host over its engines, both hosts
    serving, and each model answered mostly where the ring put it (8 clients on 4 models:
    a host the ring gave 3 holds more than 150 % of the average, and its overflow goes to
    the other, as hash-balance-factor says)."""
    spec = Spec(models=len(MODELS), slots=4, concurrency=8, drop=0.25, duration=30,
                warmup=3, request_timeout=60)
    result = soak_through(balancer, hosts, spec, MODELS)
    assert result["passed"], (result["reasons"], result["requests"], balancer_events())
    assert result["requests"]["ok"] > 100 and result["requests"]["dropped"] > 10, result
    served = result["answered_200_by_host_and_model"]
    assert all(sum(h.values()) > 0 for h in served), served
    for model in MODELS:
        assert max(h[model] for h in served) > sum(h[model] for h in served) / 2, served


def balancer_events() -> str:
    """What HAProxy logged besides answers of 200 (servers going down or up, retries): what
    a failure here is read with."""
    lines = BALANCER_LOG[0].read_text().splitlines() if BALANCER_LOG else []
    return "\n".join(line for line in lines if '"POST' not in line or " 200 " not in line)[-4000:]


def under_load(url: str, event: Callable[[], object]) -> Counter[int]:
    """Clients on every model, back to back, with event in their midst: each answer's
    status, counted."""
    statuses: Counter[int] = Counter()
    lock = threading.Lock()
    stop_sending = threading.Event()

    def client(model: str) -> None:
        while not stop_sending.is_set():
            got = status(url, chat(model))
            with lock:
                statuses[got] += 1

    threads = [threading.Thread(target=client, args=(m,)) for m in MODELS]
    for t in threads:
        t.start()
    time.sleep(2)
    event()
    time.sleep(3)
    stop_sending.set()
    for t in threads:
        t.join(timeout=DEADLINE_S)
    return statuses
