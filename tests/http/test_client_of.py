"""Who asks, as the order's grace tells clients apart (http/openai_api.client_of)."""

from __future__ import annotations

from unittest import mock

from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from gatewayd.core.auth import ApiKey
from gatewayd.http.openai_api import client_of


def asked_from(peer: object) -> web.Request:
    transport = mock.Mock()
    transport.get_extra_info = lambda name, default=None: peer if name == "peername" \
        else default
    return make_mocked_request("POST", "/v1/chat/completions", transport=transport)


def test_a_client_is_its_host_whatever_the_connection() -> None:
    # curl and many scripts open a connection per request: the same client all the same
    assert client_of(asked_from(("127.0.0.1", 40001)), None) \
        == client_of(asked_from(("127.0.0.1", 40002)), None) == "@127.0.0.1"
    assert client_of(asked_from(("10.0.0.7", 40001)), None) == "@10.0.0.7"
    assert client_of(asked_from(("::1", 5, 0, 0)), None) == "@::1"


def test_keys_tell_clients_of_one_host_apart() -> None:
    alice, bob = KEY("alice"), KEY("bob")
    assert client_of(asked_from(("127.0.0.1", 1)), alice) == "alice@127.0.0.1"
    assert client_of(asked_from(("127.0.0.1", 1)), alice) \
        != client_of(asked_from(("127.0.0.1", 1)), bob)


def test_a_unix_socket_client_is_not_told_apart() -> None:
    assert client_of(asked_from(""), None) is None


def KEY(name: str) -> ApiKey:
    return ApiKey(name=name, sha256="0" * 64, models=frozenset({"*"}), scopes=frozenset())
