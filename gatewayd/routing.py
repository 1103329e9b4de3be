"""Which engine answers a request. Pure: names and engine states in, a model id out.

- `model` given (JSON body, multipart field or ?model=): resolved through the
  catalog's names; unknown → 404 model_not_found with the available models; a
  known model without a ready engine → the same 404, with how to start it
  (until on-demand loading arrives).
- no `model` on a /v1 path: the one ready engine, else 400 model_required.
- no `model` elsewhere (/props, /metrics, /slots, …): the default engine — the
  configured default_model if it is ready, else the first ready engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from gatewayd.catalog import Catalog
from gatewayd.engines import Engine, EngineState
from gatewayd.errors import ModelNotFound, ModelRequired, NoEngineReady


def choose_engine(path: str, model: str | None, *, catalog: Catalog,
                  engines: Sequence[Engine], default_model: str | None) -> Engine:
    ready = [e for e in engines if e.state is EngineState.READY]
    if model is not None:
        by_id = {e.model_id: e for e in engines}
        model_id = model if model in by_id else catalog.resolve(model).id
        engine = by_id.get(model_id)
        if engine is None or engine.state is not EngineState.READY:
            state = engine.state.value if engine else EngineState.STOPPED.value
            raise ModelNotFound(
                f"model {model_id!r} is not loaded (engine {state}); start it with "
                f"`llm-gateway start {model_id}` or POST /admin/engines/start",
                param="model", available_models=[e.model_id for e in ready],
                state=state)
        return engine
    if path.startswith("/v1/"):
        if len(ready) == 1:
            return ready[0]
        raise ModelRequired(
            "this request needs a \"model\": " + (
                f"{len(ready)} engines are ready" if ready else "no engine is ready"),
            param="model", available_models=[e.model_id for e in ready] or catalog.ids)
    if default_model is not None:
        try:
            default_id = catalog.resolve(default_model).id
        except ModelNotFound:
            default_id = default_model
        for engine in ready:
            if engine.model_id == default_id:
                return engine
    if ready:
        return ready[0]
    raise NoEngineReady("no engine is ready to answer this request; start one with "
                        "`llm-gateway start MODEL`", available_models=catalog.ids)
