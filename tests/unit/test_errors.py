from __future__ import annotations

from gatewayd.core.errors import (
    AccessDenied,
    EngineLimitReached,
    ErrorSource,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    UnitOperationFailed,
    anthropic_error_body,
    error_body,
)


def test_error_body_is_openai_shaped_with_extras() -> None:
    err = InvalidRequest("bad field", param="model", available_models=["a"])
    assert err.status == 400
    assert err.body() == {"error": {"message": "bad field", "type": "invalid_request_error",
                                    "param": "model", "code": "invalid_request",
                                    "available_models": ["a"], "source": "gateway"},
                          "available_models": ["a"]}   # the seed's shape: beside `error` too


def test_anthropic_body_has_anthropic_types_by_status() -> None:
    err = ModelNotFound("no model 'x'", param="model", available_models=["a", "b"])
    assert err.anthropic_body() == {
        "type": "error", "error": {"type": "not_found_error", "message": "no model 'x'",
                                   "code": "model_not_found", "source": "gateway"},
        "available_models": ["a", "b"]}
    assert InvalidRequest("bad").anthropic_body()["error"]["type"] == "invalid_request_error"
    assert EngineLimitReached("full").anthropic_body()["error"]["type"] == "overloaded_error"
    assert UnitOperationFailed("x").anthropic_body()["error"]["type"] == "api_error"
    assert AccessDenied("no").anthropic_body()["error"]["type"] == "permission_error"


def test_subclasses_keep_their_own_status() -> None:
    assert GatewayError("x").status == 500
    assert UnitOperationFailed("x").status == 502
    denied = AccessDenied("no")
    assert isinstance(denied, UnitOperationFailed) and denied.status == 403
    assert denied.body()["error"]["code"] == "access_denied"


def test_the_gateways_own_errors_say_so_and_retold_words_do_not() -> None:
    """`source` inside `error` (core/errors.ErrorSource): the gateway's own in either
    dialect, not to be overridden by an extra; an engine's words retold in Anthropic's
    shape carry none (the relay's header says whose they are)."""
    assert InvalidRequest("bad", source="engine").body()["error"]["source"] == "gateway"
    assert ModelNotFound("no").anthropic_body()["error"]["source"] == "gateway"
    assert error_body("x", type_="server_error", code=None)["error"]["source"] == "gateway"
    retold = anthropic_error_body(400, "too long", source=None)
    assert retold == {"type": "error", "error": {"type": "invalid_request_error",
                                                 "message": "too long"}}
    assert [s.value for s in ErrorSource] == ["gateway", "engine", "upstream"]
