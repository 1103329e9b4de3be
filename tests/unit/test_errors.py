from __future__ import annotations

from gatewayd.core.errors import AccessDenied, GatewayError, InvalidRequest, UnitOperationFailed


def test_error_body_is_openai_shaped_with_extras() -> None:
    err = InvalidRequest("bad field", param="model", available_models=["a"])
    assert err.status == 400
    assert err.body() == {"error": {"message": "bad field", "type": "invalid_request_error",
                                    "param": "model", "code": "invalid_request",
                                    "available_models": ["a"]}}


def test_subclasses_keep_their_own_status() -> None:
    assert GatewayError("x").status == 500
    assert UnitOperationFailed("x").status == 502
    denied = AccessDenied("no")
    assert isinstance(denied, UnitOperationFailed) and denied.status == 403
    assert denied.body()["error"]["code"] == "access_denied"
