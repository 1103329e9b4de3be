"""Variants and LoRA adapters (core/variants, core/catalog): what a name changes in a
request's body, and which configurations are refused, with the key named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gatewayd.core.catalog import ModelFile, build_catalog
from gatewayd.core.config import ModelConfig, parse_config
from gatewayd.core.config_schema import ModelKind
from gatewayd.core.engine_units import EngineLayout, server_argv
from gatewayd.core.errors import AdapterNotLoaded, ConfigError, InvalidRequest, ModelNotFound
from gatewayd.core.model_facts import GgufFacts
from gatewayd.core.priority import HIGH, LOW, NORMAL
from gatewayd.core.routing import choose_model
from gatewayd.core.variants import Applied, Shape, shape_body, with_adapters

BASE = {"path": "/m/qwen.gguf",
        "adapters": {"sql": "/m/sql.gguf", "fr": {"path": "/m/fr.gguf", "scale": 0.5,
                                                  "aliases": ["french"]}}}


def catalog_of(models: dict[str, Any], **files: ModelFile) -> Any:
    config = parse_config({"models": models})
    return build_catalog(config, (), {Path(p): f for p, f in files.items()})


# -- what a body gets -----------------------------------------------------------------

def test_a_default_fills_only_what_the_client_left_out() -> None:
    shape = Shape(defaults={"temperature": 0.2, "top_k": 5})
    payload: dict[str, Any] = {"messages": [], "temperature": 0.9}
    assert shape_body(shape, "/v1/chat/completions", payload)
    assert payload == {"messages": [], "temperature": 0.9, "top_k": 5}


def test_a_default_table_is_merged_key_by_key_with_the_clients() -> None:
    shape = Shape(defaults={"chat_template_kwargs": {"enable_thinking": False, "x": 1}})
    payload: dict[str, Any] = {"chat_template_kwargs": {"x": 2, "y": 3}}
    shape_body(shape, "/v1/chat/completions", payload)
    assert payload["chat_template_kwargs"] == {"enable_thinking": False, "x": 2, "y": 3}
    # and the variant's own table is never changed by a request
    assert shape.defaults["chat_template_kwargs"] == {"enable_thinking": False, "x": 1}


def test_nothing_to_change_says_so() -> None:
    payload: dict[str, Any] = {"temperature": 0.9}
    assert not shape_body(Shape(defaults={"temperature": 0.2}), "/v1/chat/completions",
                          payload)
    assert not shape_body(Shape(), "/v1/chat/completions", payload)


@pytest.mark.parametrize(("path", "given", "expected"), [
    ("/v1/chat/completions", {}, {"max_tokens": 64}),
    ("/v1/chat/completions", {"max_tokens": 10}, {"max_tokens": 10}),
    ("/v1/chat/completions", {"max_tokens": 1000}, {"max_tokens": 64}),
    ("/v1/chat/completions", {"max_completion_tokens": 1000}, {"max_completion_tokens": 64}),
    # llama-server reads n_predict on every path, before max_tokens: it is lowered too
    ("/v1/chat/completions", {"max_tokens": 5, "n_predict": 100000},
     {"max_tokens": 5, "n_predict": 64}),
    ("/v1/chat/completions", {"n_predict": -1}, {"n_predict": 64}),   # -1: no end
    ("/completion", {}, {"n_predict": 64}),
    ("/v1/responses", {}, {"max_output_tokens": 64}),
    ("/v1/responses", {"max_output_tokens": 99}, {"max_output_tokens": 64}),
    ("/v1/messages", {"max_tokens": 4096}, {"max_tokens": 64}),
])
def test_a_limit_holds_whatever_the_client_asks(path: str, given: dict[str, Any],
                                                expected: dict[str, Any]) -> None:
    payload = dict(given)
    shape_body(Shape(max_tokens=64), path, payload)
    assert payload == expected


def test_a_length_left_null_is_one_not_given_and_a_length_default_yields_to_any_length(
        ) -> None:
    payload: dict[str, Any] = {"max_tokens": None}
    shape_body(Shape(max_tokens=64), "/v1/chat/completions", payload)
    assert payload == {"max_tokens": 64}
    payload = {"max_completion_tokens": 10}
    shape_body(Shape(defaults={"max_tokens": 500, "top_k": 3}), "/v1/chat/completions",
               payload)
    assert payload == {"max_completion_tokens": 10, "top_k": 3}


def test_the_responses_system_prompt_yields_to_a_system_message_in_the_input() -> None:
    payload: dict[str, Any] = {"input": [{"role": "developer", "content": "mine"}],
                               "instructions": None}
    shape_body(Shape(system_prompt="Be terse."), "/v1/responses", payload)
    assert "instructions" not in payload or payload["instructions"] is None
    payload = {"input": "hi", "instructions": None}
    shape_body(Shape(system_prompt="Be terse."), "/v1/responses", payload)
    assert payload["instructions"] == "Be terse."


def test_a_limit_beats_a_default_and_a_length_that_is_no_number_is_the_clients_400() -> None:
    payload: dict[str, Any] = {}
    shape_body(Shape(defaults={"max_tokens": 500}, max_tokens=64), "/v1/completions", payload)
    assert payload == {"max_tokens": 64}
    for bad in ("5", 2.5, True):
        with pytest.raises(InvalidRequest) as refused:
            shape_body(Shape(max_tokens=64), "/v1/chat/completions", {"max_tokens": bad})
        assert refused.value.param == "max_tokens"


@pytest.mark.parametrize(("path", "given", "expected"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
     {"messages": [{"role": "system", "content": "Be terse."},
                   {"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "mine"}]},
     {"messages": [{"role": "system", "content": "mine"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "developer", "content": "mine"}]},
     {"messages": [{"role": "developer", "content": "mine"}]}),
    ("/v1/messages", {"messages": []}, {"messages": [], "system": "Be terse."}),
    ("/v1/messages", {"system": "mine"}, {"system": "mine"}),
    ("/v1/responses", {"input": "hi"}, {"input": "hi", "instructions": "Be terse."}),
    ("/v1/completions", {"prompt": "hi"}, {"prompt": "hi"}),   # no system to have
])
def test_the_system_prompt_goes_first_where_the_client_sent_none(
        path: str, given: dict[str, Any], expected: dict[str, Any]) -> None:
    shape_body(Shape(system_prompt="Be terse."), path, given)
    assert given == expected


def test_the_lora_list_is_the_engines_whole_list_whatever_the_client_sent() -> None:
    loaded = ("sql", "fr")
    payload: dict[str, Any] = {"lora": [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 1.0}]}
    assert with_adapters("/v1/chat/completions", payload, loaded, None, "q")
    assert payload["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]
    payload = {}
    with_adapters("/v1/completions", payload, loaded, Applied("fr", 0.5), "q:fr")
    assert payload["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.5}]
    # the ids are the engine's: one started with (fr) alone has fr at 0
    payload = {}
    with_adapters("/v1/chat/completions", payload, ("fr",), Applied("fr", 0.5), "q:fr")
    assert payload["lora"] == [{"id": 0, "scale": 0.5}]
    payload = {}
    assert not with_adapters("/v1/chat/completions", payload, (), None, "q")
    assert payload == {}


def test_an_adapter_its_engine_did_not_load_or_a_body_without_the_list_is_refused() -> None:
    with pytest.raises(AdapterNotLoaded, match=r"'q:de'.s engine was started before") as e:
        with_adapters("/v1/chat/completions", {}, ("sql",), Applied("de", 1.0), "q:de")
    assert e.value.status == 503 and e.value.retry_after
    for path, payload in (("/v1/messages", {}), ("/v1/chat/completions", None)):
        with pytest.raises(InvalidRequest, match="LoRA adapters"):
            with_adapters(path, payload, ("sql",), None, "q")
    assert with_adapters("/v1/messages/count_tokens", {}, ("sql",), None, "q")


# -- names ----------------------------------------------------------------------------

def test_adapters_are_models_named_base_colon_adapter_and_the_base_applies_none() -> None:
    catalog = catalog_of({"qwen": BASE})
    base = catalog.served("qwen")
    assert base.variant is None and base.shape.adapter is None
    sql = catalog.served("QWEN:SQL")
    assert (sql.id, sql.model.id, sql.shape.adapter) == ("qwen:sql", "qwen",
                                                         Applied("sql", 1.0))
    assert catalog.served("french").shape.adapter == Applied("fr", 0.5)
    assert catalog.served("qwen:fr").id == "qwen:fr"
    assert [m.id for m in catalog] == ["qwen"]   # one engine
    assert catalog.served_ids() == ["qwen", "qwen:sql", "qwen:fr"]


def test_a_variant_is_its_bases_engine_with_its_own_name_class_and_shape() -> None:
    catalog = catalog_of({
        "qwen": {**BASE, "priority": "high"},
        "coder": {"variant_of": "qwen", "aliases": ["Code"], "adapter": "sql",
                  "defaults": {"temperature": 0.2}, "limits": {"max_tokens": 256},
                  "system_prompt": "You write SQL.", "priority": "low"},
        "quick": {"variant_of": "QWEN"}})
    coder = catalog.served("code")
    assert (coder.id, coder.model.id, coder.priority) == ("coder", "qwen", LOW)
    assert coder.shape == Shape(defaults={"temperature": 0.2}, system_prompt="You write SQL.",
                                max_tokens=256, adapter=Applied("sql", 1.0))
    assert coder.names == frozenset({"coder", "code"})
    assert catalog.served("quick").priority == HIGH   # the base's, unless it says
    assert catalog.find("coder") is None              # no engine of its own to start
    with pytest.raises(ModelNotFound, match=r"variant of 'qwen'.*name 'qwen'"):
        catalog.resolve("coder")


def test_routing_answers_a_variant_on_its_bases_paths_only() -> None:
    catalog = build_catalog(parse_config({"models": {
        "embed": {"path": "/m/e.gguf", "kind": "embedding"},
        "short": {"variant_of": "embed", "defaults": {"encoding_format": "base64"}}}}), (), {})
    assert choose_model("/v1/embeddings", "short", catalog=catalog, engines=[],
                        default_model=None) == "short"
    with pytest.raises(InvalidRequest, match="'short' is a variant of 'embed'"):
        choose_model("/v1/chat/completions", "short", catalog=catalog, engines=[],
                     default_model=None)


def test_a_variant_takes_a_weak_gguf_name_but_never_a_models_strong_one() -> None:
    facts = GgufFacts(path="/m/a.gguf", file_size=1, metadata={"general.name": "Qwen3"})
    catalog = catalog_of({"a": {"path": "/m/a.gguf"},
                          "v": {"variant_of": "a", "aliases": ["qwen3"]}},
                         **{"/m/a.gguf": ModelFile(size_bytes=1, facts=facts)})
    assert catalog.served("qwen3").id == "v"
    with pytest.raises(ConfigError,
                       match=r"model 'a' and variant 'v' both claim the name 'a\.gguf'"):
        catalog_of({"a": {"path": "/m/a.gguf"}, "v": {"variant_of": "a",
                                                      "aliases": ["a.gguf"]}})


# -- refused configurations, the key named ----------------------------------------------

@pytest.mark.parametrize(("models", "message"), [
    ({"v": {"variant_of": "nope"}}, r"models\.v\.variant_of = 'nope': no model is called"),
    ({"v": {"variant_of": "qwen"}, "w": {"variant_of": "v"}},
     r"models\.w\.variant_of = 'v' is itself a variant \(of 'qwen'\)"),
    ({"w": {"variant_of": "qwen:sql"}},
     r"models\.w\.variant_of = 'qwen:sql' is itself a variant.*adapter = 'sql'"),
    ({"v": {"variant_of": "qwen", "adapter": "de"}},
     r"models\.v\.adapter = 'de': 'qwen' has the adapters sql, fr"),
    ({"v": {"variant_of": "qwen", "defaults": {"stream": True}}},
     r"models\.v\.defaults: stream is not a field 'qwen'.s requests take"),
    ({"v": {"variant_of": "qwen", "defaults": {"lora": []}}}, r"models\.v\.defaults: lora"),
    ({"v": {"variant_of": "qwen", "ctx_size": 4096}},
     r"\[models\.v\] is a variant of 'qwen'.*ctx_size cannot be set here"),
    ({"v": {"variant_of": "qwen", "limits": {"max_tokens": 0}}},
     r"models\.v\.limits\.max_tokens must be a positive integer"),
    ({"v": {"variant_of": "qwen", "limits": {"temperature": 1}}},
     r"models\.v\.limits: unknown key\(s\) temperature"),
    ({"v": {"variant_of": "qwen", "defaults": {"temperature": float("nan")}}},
     r"models\.v\.defaults\.temperature = nan is not a finite number"),
    ({"v": {"variant_of": "qwen", "tempreature": 1}}, r"\[models\.v\]: unknown key"),
    ({"v": {"path": "/m/v.gguf", "defaults": {"temperature": 1}}},
     r"\[models\.v\]: defaults belong to a variant"),
    ({"v": {"variant_of": "qwen", "aliases": ["qwen:sql"]}},
     r"variant 'qwen:sql' and variant 'v' both claim the name 'qwen:sql'"),
    # a model's id is a name a variant cannot take (a model called coder in models_dir)
    ({"coder": {"path": "/m/coder.gguf"}, "v": {"variant_of": "qwen", "aliases": ["Coder"]}},
     r"model 'coder' and variant 'v' both claim the name 'coder'"),
])
def test_a_variant_that_cannot_work_is_refused_naming_its_key(
        models: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        catalog_of({"qwen": BASE, **models})


@pytest.mark.parametrize(("base", "variant", "message"), [
    ({"path": "/m/e.gguf", "kind": "embedding"}, {"defaults": {"temperature": 0.1}},
     r"temperature is not a field 'b'.s requests take \(it is an embedding model"),
    ({"path": "/m/e.gguf", "kind": "embedding"}, {"system_prompt": "x"},
     r"models\.v\.system_prompt: 'b' is an embedding model"),
    ({"path": "/m/e.gguf", "kind": "rerank"}, {"limits": {"max_tokens": 5}},
     r"models\.v\.limits\.max_tokens: 'b' is a rerank model"),
])
def test_a_default_the_bases_requests_do_not_take_is_refused(
        base: dict[str, Any], variant: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        catalog_of({"b": base, "v": {"variant_of": "b", **variant}})


@pytest.mark.parametrize(("adapters", "message"), [
    ({"a,b": "/x.gguf"}, r"models\.q\.adapters\.a,b: an adapter's name"),
    ({"sql": "/m/a,b.gguf"}, r"models\.q\.adapters\.sql\.path .*comma"),
    ({"sql": {"path": "/x.gguf", "scale": 0}}, r"models\.q\.adapters\.sql\.scale = 0"),
    ({"sql": {"path": "/x.gguf", "weight": 1}}, r"models\.q\.adapters\.sql: unknown key"),
    ({"sql": 3}, r"models\.q\.adapters\.sql must be a dict"),
])
def test_an_adapter_that_cannot_load_is_refused_naming_its_key(
        adapters: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"models": {"q": {"path": "/m/q.gguf", "adapters": adapters}}})
    with pytest.raises(ConfigError, match=r"models\.w\.adapters: LoRA adapters are loaded"):
        parse_config({"models": {"w": {"path": "/m/w.bin", "backend": "whisper",
                                       "adapters": {"a": "/a.gguf"}}}})


def test_the_engine_starts_with_every_adapter_loaded_and_none_applied() -> None:
    catalog = catalog_of({"qwen": BASE})
    argv = server_argv(catalog.get("qwen"), EngineLayout.for_model("qwen"), "/bin/llama")
    at = argv.index("--lora")
    assert argv[at:at + 3] == ["--lora", "/m/sql.gguf,/m/fr.gguf", "--lora-init-without-apply"]
    plain = catalog_of({"qwen": {"path": "/m/qwen.gguf"}}).get("qwen")
    assert "--lora" not in server_argv(plain, EngineLayout.for_model("qwen"), "/bin/llama")


def test_the_adapters_files_count_in_the_models_size(tmp_path: Path) -> None:
    from gatewayd.adapters.model_files import inspect

    for name, size in (("q.gguf", 1000), ("sql.gguf", 300), ("fr.gguf", 200)):
        (tmp_path / name).write_bytes(b"x" * size)
    config = parse_config({"models": {"qwen": {
        "path": "q.gguf", "adapters": {"sql": "sql.gguf", "fr": {"path": "fr.gguf"}}}}},
        base=tmp_path).models[0]
    found = inspect(config, read_facts=lambda path: GgufFacts(path=str(path), file_size=1000))
    assert (found.size_bytes, found.adapter_bytes) == (1500, 500)


def test_a_variant_priority_of_none_is_its_bases_class() -> None:
    catalog = catalog_of({"qwen": {"path": "/m/q.gguf"}, "v": {"variant_of": "qwen"}})
    assert catalog.served("v").priority == NORMAL
    assert ModelKind.CHAT in catalog.served("v").model.kinds


def test_check_lists_the_variants_refuses_a_broken_one_and_warns_of_a_missing_adapter(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gatewayd import cli

    (tmp_path / "q.gguf").write_bytes(b"GGUF")
    (tmp_path / "sql.gguf").write_bytes(b"GGUF")
    cfg = tmp_path / "gateway.toml"
    cfg.write_text('llama_server = "/bin/true"\n[models.q]\npath = "q.gguf"\n'
                   '[models.q.adapters]\nsql = "sql.gguf"\nfr = "fr.gguf"\n'
                   '[models.fast]\nvariant_of = "q"\ndefaults = { temperature = 0.1 }\n')
    assert cli.main(["--config", str(cfg), "check"]) == 0
    out = capsys.readouterr().out
    assert "3 variant(s): q:sql, q:fr, fast" in out
    assert f"q: adapter 'fr': no file {tmp_path / 'fr.gguf'}" in out
    assert "'sql'" not in out
    cfg.write_text(cfg.read_text() + '[listen]\ndrain_notice_s = 20\n')
    assert cli.main(["--config", str(cfg), "check"]) == 0
    assert "drain_notice_s + shutdown_timeout_s = 50 s" in capsys.readouterr().out
    unit = (Path(__file__).resolve().parents[2] / "units" / "llm-gateway.service").read_text()
    assert f"\nTimeoutStopSec={cli.UNIT_STOP_S}\n" in unit   # the figure the warning uses
    cfg.write_text(cfg.read_text() + '[models.slow]\nvariant_of = "fast"\n')
    assert cli.main(["--config", str(cfg), "check"]) == 1
    assert "models.slow.variant_of = 'fast' is itself a variant" in capsys.readouterr().err


def test_an_adapter_file_in_models_dir_is_no_model_and_serves_its_base(tmp_path: Path) -> None:
    """What `llm-gateway pull ORG/REPO:FILE --name sql-lora` leaves (models_dir/sql-lora/)
    or a user puts beside the base: the header says adapter, so the catalog lists no model
    for it, and a model's adapters may name it."""
    import make_tiny_model

    from gatewayd.adapters.model_files import load_catalog

    models = tmp_path / "models"
    (models / "sql-lora").mkdir(parents=True)
    make_tiny_model.write_model(str(models / "tiny.gguf"), "tiny")
    make_tiny_model.write_lora(str(models / "sql-lora" / "sql.gguf"), "tiny-sql")
    make_tiny_model.write_lora(str(models / "loose-lora.gguf"), "tiny-loose", seed=1)
    config = parse_config({"models_dir": str(models)})
    assert load_catalog(config).served_ids() == ["tiny"]
    config = parse_config({"models_dir": str(models), "models": {"tiny": {
        "path": str(models / "tiny.gguf"), "adapters": {"sql": "models/sql-lora/sql.gguf"}}}},
        base=tmp_path)
    catalog = load_catalog(config)
    assert catalog.served_ids() == ["tiny", "tiny:sql"]
    tiny = catalog.get("tiny")
    assert tiny is not None and tiny.adapter_bytes == (models / "sql-lora/sql.gguf").stat().st_size
    with pytest.raises(ConfigError, match=r"\[models\.oops\] path .* is a LoRA adapter"):
        load_catalog(parse_config({"models": {"oops": {"path": str(models / "loose-lora.gguf")}}}))


def test_an_engines_adapters_are_in_its_environment_and_read_back_when_adopted() -> None:
    from gatewayd.adapters.unit_control import info_from_properties
    from gatewayd.core.engine_units import adapters_of, engine_env

    catalog = catalog_of({"qwen": BASE, "plain": {"path": "/m/p.gguf"}})
    env = engine_env(catalog.get("qwen"), EngineLayout.for_model("qwen"))
    assert adapters_of(env) == ("sql", "fr")
    service = {"Environment": [f"{k}={v}" for k, v in env.items()]}
    assert info_from_properties("u", {}, service).adapters == ("sql", "fr")
    plain = engine_env(catalog.get("plain"), EngineLayout.for_model("plain"))
    assert adapters_of(plain) == ()               # an engine of ours with none
    assert adapters_of({}) is None                # not an engine's environment: unknown


def test_a_variant_cannot_be_called_as_a_model_found_in_models_dir() -> None:
    config = parse_config({"models": {"qwen": BASE, "coder": {"variant_of": "qwen"}}})
    found = [ModelConfig(name="coder", path=Path("/m/coder/coder.gguf"))]
    with pytest.raises(ConfigError, match="model 'coder' and variant 'coder' both claim"):
        build_catalog(config, found, {})
