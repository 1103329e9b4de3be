"""Names that share one engine: variants and LoRA adapters. Pure.

- A **variant** (`[models.NAME] variant_of = "BASE"`) is another model name for BASE's
  engine with request defaults (the client's own values win), a default system prompt,
  and limits (the gateway's value wins: `limits.max_tokens`). No second engine, no
  reload: a request for it goes to BASE's engine with its body changed (`shape_body`).
- A **LoRA adapter** (`[models.BASE] adapters = { sql = "sql.gguf" }`) is loaded into
  BASE's llama-server at its start, unapplied (`--lora ... --lora-init-without-apply`);
  `BASE:sql` names it, and a request for it is sent with llama-server's per-request
  `lora` list. Every inference request to an engine with adapters carries the whole list,
  the base's all zeros (`with_adapters`): llama-server applies every adapter at scale 1 to
  a request without one, and keeps a prompt cached under another adapter set unless the
  list is non-empty (both measured; ../shared/notes/llama-server.md). The list is made
  from the adapters the engine itself was started with (its ids are their positions), not
  from the configuration in force: a reload that changes them restarts the engine only
  once it is idle, and a gateway restart adopts the engine as it runs.

The catalog (core/catalog) resolves the names; this module reads the tables and
changes bodies.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from gatewayd.core.config_schema import ModelKind, expect, known, no_unknown, read_table
from gatewayd.core.errors import AdapterNotLoaded, ConfigError, InvalidRequest

# what a variant's `defaults` may set, by its base's kind: request fields its engine
# takes (llama-server's sampling and template options; OpenAI's for the media kinds).
# A list, not a refusal list: a default that would change what is asked (messages,
# model, stream) or how it is sent (lora) is no default.
DEFAULTS_FOR: Mapping[ModelKind, frozenset[str]] = {
    ModelKind.CHAT: frozenset({
        "temperature", "top_p", "top_k", "min_p", "typical_p", "top_n_sigma",
        "presence_penalty", "frequency_penalty", "repeat_penalty", "repeat_last_n",
        "dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
        "xtc_probability", "xtc_threshold", "mirostat", "mirostat_tau", "mirostat_eta",
        "seed", "stop", "max_tokens", "n_probs", "logit_bias", "samplers", "grammar",
        "json_schema", "response_format", "chat_template_kwargs", "reasoning_format",
        "reasoning_effort", "parallel_tool_calls", "tool_choice"}),
    ModelKind.EMBEDDING: frozenset({"encoding_format", "embd_normalize"}),
    ModelKind.RERANK: frozenset({"top_n"}),
    ModelKind.AUDIO: frozenset(),     # multipart uploads: no JSON body to change
    ModelKind.IMAGE: frozenset({"size", "quality", "style", "n", "response_format",
                                "background", "output_format"}),
    ModelKind.SPEECH: frozenset({"voice", "response_format", "speed", "instructions"}),
}
LIMITS = frozenset({"max_tokens"})
# the fields in which engines read an answer's length (llama-server reads n_predict on
# every path, before max_tokens): a limit lowers each one given
LENGTH_FIELDS = ("n_predict", "max_tokens", "max_completion_tokens", "max_output_tokens")
# the field a path's length is set in when the client gave none
_LENGTH_FIELD_OF = {"/v1/responses": "max_output_tokens", "/completion": "n_predict",
                    "/completions": "n_predict", "/infill": "n_predict"}
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
SEPARATOR = ":"   # BASE:ADAPTER
_ADAPTER_KEYS = frozenset({"path", "scale", "aliases"})


class Applied(NamedTuple):
    """The adapter a name applies, and at what scale."""
    name: str
    scale: float


class Adapter(NamedTuple):
    """One LoRA adapter of a llama model: its name (BASE:name asks for it), its file, the
    scale a request for it is sent with, more names."""
    name: str
    path: Path
    scale: float = 1.0
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class VariantConfig:
    """One `[models.NAME]` table with `variant_of`."""
    name: str
    variant_of: str
    aliases: tuple[str, ...] = ()
    adapter: str | None = None          # one of the base's adapters, applied
    defaults: Mapping[str, Any] = field(default_factory=dict)
    system_prompt: str | None = None
    max_tokens: int | None = None       # limits.max_tokens
    priority: int | None = None         # None: the base's


@dataclass(frozen=True)
class Shape:
    """What a model name changes in the JSON bodies of its requests (the adapter it
    applies goes in at the engine: with_adapters)."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    system_prompt: str | None = None
    max_tokens: int | None = None
    adapter: Applied | None = None

    @property
    def changes_anything(self) -> bool:
        return bool(self.defaults or self.system_prompt is not None
                    or self.max_tokens is not None)


NO_CHANGE = Shape()


def parse_variant(name: str, table: Mapping[str, Any], where: str) -> VariantConfig:
    """A variant's table; its engine's keys (path, args, ...) are refused by name: they
    are its base's."""
    key = f"models.{name}"
    base_name = table.get("variant_of")
    engine_keys = sorted(k for k in set(table) - known("models.VARIANT")
                         if k in known("models.NAME"))
    if engine_keys:
        raise ConfigError(
            f"{where}: [{key}] is a variant of {base_name!r}: it runs on that model's "
            f"engine, so {', '.join(engine_keys)} cannot be set here (set "
            f"{'it' if len(engine_keys) == 1 else 'them'} on [models.{base_name}], or "
            f"make [{key}] a model of its own); a variant takes "
            f"{', '.join(sorted(known('models.VARIANT')))}")
    no_unknown(table, "models.VARIANT", f"{where} [{key}]")
    values = read_table(table, "models.VARIANT", where, f"{key}.", Path("."))
    base = values["variant_of"]
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{where}: {key}.variant_of must name the model it is a variant of")
    limits = expect(table.get("limits", {}), dict, where, f"{key}.limits")
    no_unknown_in(limits, LIMITS, where, f"{key}.limits")
    max_tokens = limits.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int)
                                   or isinstance(max_tokens, bool) or max_tokens < 1):
        raise ConfigError(f"{where}: {key}.limits.max_tokens must be a positive integer, "
                          f"not {max_tokens!r}")
    defaults = expect(table.get("defaults", {}), dict, where, f"{key}.defaults")
    _finite(defaults, where, f"{key}.defaults")
    prompt = values["system_prompt"]
    if prompt is not None and not prompt.strip():
        raise ConfigError(f"{where}: {key}.system_prompt is empty (leave it out instead)")
    return VariantConfig(name=name, variant_of=base.strip(), aliases=values["aliases"],
                         adapter=values["adapter"], defaults=defaults, system_prompt=prompt,
                         max_tokens=max_tokens, priority=values["priority"])


def no_unknown_in(table: Mapping[str, Any], allowed: frozenset[str], where: str,
                  key: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(f"{where}: {key}: unknown key(s) {', '.join(unknown)}; known: "
                          f"{', '.join(sorted(allowed))}")


def _finite(value: Any, where: str, key: str) -> None:
    """TOML has inf and nan; JSON has neither: a default must be sendable."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where}: {key} = {value} is not a finite number")
    if isinstance(value, dict):
        for k, v in value.items():
            _finite(v, where, f"{key}.{k}")
    if isinstance(value, list):
        for i, v in enumerate(value):
            _finite(v, where, f"{key}[{i}]")


def check_defaults(variant: VariantConfig, kinds: tuple[ModelKind, ...], where: str) -> None:
    """Its defaults and system prompt are ones its base's engine takes (by its kinds)."""
    key = f"models.{variant.name}"
    allowed = frozenset().union(*(DEFAULTS_FOR[k] for k in kinds))
    wrong = sorted(set(variant.defaults) - allowed)
    shown = "/".join(k.value for k in kinds)
    if wrong:
        known = ", ".join(sorted(allowed)) or "none"
        raise ConfigError(f"{where}: {key}.defaults: {', '.join(wrong)} is not a field "
                          f"{variant.variant_of!r}'s requests take (it is {_a(shown)} "
                          f"model; the defaults it takes: {known})")
    generates = ModelKind.CHAT in kinds
    if variant.system_prompt is not None and not generates:
        raise ConfigError(f"{where}: {key}.system_prompt: {variant.variant_of!r} is "
                          f"{_a(shown)} model; only a chat model's requests have a system "
                          "prompt")
    if variant.max_tokens is not None and not generates:
        raise ConfigError(f"{where}: {key}.limits.max_tokens: {variant.variant_of!r} is "
                          f"{_a(shown)} model, which generates no tokens")


def _a(word: str) -> str:
    return f"{'an' if word[:1] in tuple('aeiou') else 'a'} {word}"


def parse_adapters(value: Any, where: str, key: str, base: Path) -> tuple[Adapter, ...]:
    """`adapters = { sql = "sql.gguf", fr = { path = "fr.gguf", scale = 0.8,
    aliases = ["french"] } }`; a relative path is taken from base."""
    table = expect(value, dict, where, key)
    adapters = []
    for name, entry in table.items():
        here = f"{key}.{name}"
        if not ADAPTER_NAME.fullmatch(name):
            raise ConfigError(f"{where}: {here}: an adapter's name is letters, digits, _, . "
                              "and - (up to 64; not starting with . or -)")
        if isinstance(entry, str):
            entry = {"path": entry}
        expect(entry, dict, where, here)
        no_unknown_in(entry, _ADAPTER_KEYS, where, here)
        text = expect(entry.get("path"), str, where, f"{here}.path")
        if "," in text or not text.strip():
            raise ConfigError(f"{where}: {here}.path {text!r}: an adapter's path cannot be "
                              "empty or hold a comma (llama-server's --lora list is "
                              "comma-separated)")
        path = Path(text).expanduser()
        scale = expect(entry.get("scale", 1.0), (int, float), where, f"{here}.scale")
        if isinstance(scale, bool) or not math.isfinite(scale) or not 0 < scale <= 10:
            raise ConfigError(f"{where}: {here}.scale = {scale!r}: allowed > 0 up to 10")
        aliases = expect(entry.get("aliases", []), list, where, f"{here}.aliases")
        for i, alias in enumerate(aliases):
            expect(alias, str, where, f"{here}.aliases[{i}]")
        adapters.append(Adapter(name=name, path=path if path.is_absolute() else base / path,
                                scale=float(scale), aliases=tuple(aliases)))
    return tuple(adapters)


def adapter_args(adapters: tuple[Adapter, ...]) -> list[str]:
    """llama-server's flags that load them all, unapplied (a request applies them)."""
    if not adapters:
        return []
    return ["--lora", ",".join(str(a.path) for a in adapters), "--lora-init-without-apply"]


def adapter_env(adapters: tuple[Adapter, ...]) -> str:
    """The engine's adapters in --lora's order, as its environment keeps them (an
    adopted engine's are read back from there): names, comma-separated."""
    return ",".join(a.name for a in adapters)


def loaded_adapters(started: tuple[str, ...] | None,
                    configured: tuple[Adapter, ...]) -> tuple[str, ...]:
    """The adapters an engine loaded: those it was started with (Engine.adapters), else,
    where unknown, the configuration's."""
    return started if started is not None else tuple(a.name for a in configured)


def with_adapters(path: str, payload: dict[str, Any] | None, loaded: tuple[str, ...],
                  applied: Applied | None, model_id: str) -> bool:
    """payload given the engine's whole lora list: applied at its scale, every other
    adapter the engine loaded (loaded, in its --lora order) at 0; whether it changed.
    An engine without adapters gets none; an adapter the engine has not loaded is
    AdapterNotLoaded. Only inference paths (inference: True) carry one; a body that cannot
    carry the list there, and llama-server's Anthropic path (which drops it and would
    apply every adapter), are the client's 400. The client's own `lora` is replaced."""
    if applied is not None and applied.name not in loaded:
        raise AdapterNotLoaded(
            f"{model_id!r}'s engine was started before adapter {applied.name!r} was "
            "configured; it restarts with it once idle: try again shortly",
            retry_after=5)
    if not loaded:
        return False
    if path.startswith("/v1/messages") and not path.endswith("/count_tokens"):
        raise InvalidRequest(
            f"{model_id!r} runs on an engine with LoRA adapters, and llama-server's "
            "Anthropic endpoint drops the per-request adapter list (it would apply every "
            "adapter): ask /v1/chat/completions for it", param="model")
    if payload is None:
        raise InvalidRequest(
            f"{model_id!r} runs on an engine with LoRA adapters, whose choice the gateway "
            "sets in a JSON body: this request has none (an upload, or no body)",
            param="model")
    payload["lora"] = [{"id": i, "scale": applied.scale if applied is not None
                        and name == applied.name else 0.0} for i, name in enumerate(loaded)]
    return True


def shape_body(shape: Shape, path: str, payload: dict[str, Any]) -> bool:
    """payload changed in place as shape says; whether anything changed. Defaults fill
    what the client left out (a table merged key by key); the system prompt goes first
    where the client sent none; the limit lowers every length field given (and sets the
    path's own where none is); the lora list is the gateway's, whatever the client sent.
    A length that is not a whole number is the client's 400; a length the client left
    null is one it did not give."""
    if not shape.changes_anything:
        return False
    before = copy.deepcopy(payload)
    for name in LENGTH_FIELDS:
        if name in payload and payload[name] is None:
            del payload[name]
    lengths_given = any(name in payload for name in LENGTH_FIELDS)
    for name, value in shape.defaults.items():
        if name in LENGTH_FIELDS and lengths_given:
            continue   # the client said how long, in another field
        payload[name] = _merged(value, payload[name]) if name in payload \
            else copy.deepcopy(value)
    if shape.system_prompt is not None:
        _add_system_prompt(shape.system_prompt, path, payload)
    if shape.max_tokens is not None:
        _limit_length(shape.max_tokens, path, payload)
    return before != payload


def _merged(default: Any, given: Any) -> Any:
    """The client's value, with a default table's keys it left out."""
    if isinstance(default, dict) and isinstance(given, dict):
        return {**copy.deepcopy(default),
                **{k: _merged(default[k], v) if k in default else v for k, v in given.items()}}
    return given


def _add_system_prompt(prompt: str, path: str, payload: dict[str, Any]) -> None:
    if path.startswith("/v1/messages"):       # Anthropic's: a top-level `system`
        payload.setdefault("system", prompt)
    elif path == "/v1/responses":            # OpenAI's Responses: `instructions`
        given = payload.get("input")
        if payload.get("instructions") is None and not (isinstance(given, list) and any(
                isinstance(m, dict) and m.get("role") in ("system", "developer")
                for m in given)):
            payload["instructions"] = prompt
    elif isinstance(messages := payload.get("messages"), list) and not any(
            isinstance(m, dict) and m.get("role") in ("system", "developer")
            for m in messages):
        payload["messages"] = [{"role": "system", "content": prompt}, *messages]


def _limit_length(limit: int, path: str, payload: dict[str, Any]) -> None:
    given = False
    for name in LENGTH_FIELDS:
        if name not in payload:
            continue
        value = payload[name]
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidRequest(f"{name} must be an integer", param=name)
        given = True
        if value < 0 or value > limit:   # (llama-server's -1: no end)
            payload[name] = limit
    if not given:
        payload[_LENGTH_FIELD_OF.get(path, "max_tokens")] = limit
