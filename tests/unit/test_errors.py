from __future__ import annotations

from gatewayd.core.errors import (
    AccessDenied,
    EngineLimitReached,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    UnitOperationFailed,
)


def test_error_body_is_openai_shaped_with_extras() -> None:
    err = InvalidRequest("bad field", param="model", available_models=["a"])
    assert err.status == 400
    assert err.body() == {"error": {"message": "bad field", "type": "invalid_request_error",
                                    "param": "model", "code": "invalid_request",
                                    "available_models": ["a"]},
                          "available_models": ["a"]}   # the seed's shape: beside `error` too


def test_anthropic_body_has_anthropic_types_by_status() -> None:
    err = ModelNotFound("no model 'x'", param="model", available_models=["a", "b"])
    assert err.anthropic_body() == {
        "type": "error", "error": {"type": "not_found_error", "message": "no model 'x'",
                                   "code": "model_not_found"},
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
