"""Settings from YAML, KVGATE_* env vars and flags; validation errors name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.backends.config import parse_worker_spec
from kvgate.router import serve
from kvgate.router.config import ConfigError, Settings, load_settings
from kvgate.router.flags import given_settings


def flags(*argv: str) -> dict[str, object]:
    return given_settings(serve.build_parser().parse_args(list(argv)), Settings)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvgate.yaml"
    path.write_text(text)
    return path


YAML = """
port: 9000
policy: round_robin
workers:
  - http://127.0.0.1:9001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558
  - url: http://127.0.0.1:9002/
    engine: sglang
    models: [m1, m2]
    api_key: upstream-secret
health:
  interval_s: 5
  failure_threshold: 2
"""


def test_yaml_env_and_flags_with_precedence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, YAML)
    settings = load_settings(path)
    assert settings.port == 9000 and settings.policy == "round_robin"
    first, second = settings.workers
    assert first.url == "http://127.0.0.1:9001" and first.engine == "vllm"
    assert first.events == "tcp://127.0.0.1:5557" and first.replay == "tcp://127.0.0.1:5558"
    assert second.url == "http://127.0.0.1:9002" and second.models == ["m1", "m2"]
    assert second.api_key is not None and second.api_key.get_secret_value() == "upstream-secret"
    assert settings.health.interval_s == 5 and settings.health.failure_threshold == 2

    monkeypatch.setenv("KVGATE_PORT", "9100")
    monkeypatch.setenv("KVGATE_HEALTH__INTERVAL_S", "7")
    settings = load_settings(path)
    assert settings.port == 9100 and settings.health.interval_s == 7
    assert settings.health.failure_threshold == 2  # nested YAML values survive an env override

    settings = load_settings(path, flags("--port", "9200", "--health-interval-s", "0.5"))
    assert settings.port == 9200 and settings.health.interval_s == 0.5
    assert len(settings.workers) == 2


def tokenizer_for(settings: Settings, model: str) -> str | None:
    return settings.tokenizers.get(model, settings.tokenizers.get("*"))


def test_cli_worker_form_and_repeatable_flags() -> None:
    overrides = flags(
        "--worker", "http://127.0.0.1:9001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558",
        "--worker", "http://127.0.0.1:9002,engine=sglang,models=a;b",
        "--tokenizer", "/tok/default",
        "--tokenizer", "m1=/tok/m1",
        "--api-key", "k1", "--api-key", "k2",
        "--no-capture-usage",
    )  # fmt: skip
    settings = load_settings(None, overrides)
    assert [w.url for w in settings.workers] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    assert settings.workers[1].models == ["a", "b"] and settings.workers[1].engine == "sglang"
    assert tokenizer_for(settings, "m1") == "/tok/m1"
    assert tokenizer_for(settings, "other") == "/tok/default"
    assert [k.get_secret_value() for k in settings.api_keys] == ["k1", "k2"]
    assert settings.capture_usage is False
    assert parse_worker_spec("http://h:1,models=x") == {"url": "http://h:1", "models": ["x"]}


def test_scoring_knobs_are_serve_flags() -> None:
    """The operator's overlap credit and tier weights reach the kv policy's config."""
    overrides = flags(
        "--scoring-overlap-credit", "2", "--scoring-cpu-weight", "0.5",
        "--scoring-disk-weight", "0.1",
    )  # fmt: skip
    scoring = load_settings(None, overrides).scoring
    assert (scoring.overlap_credit, scoring.cpu_weight, scoring.disk_weight) == (2, 0.5, 0.1)
    with pytest.raises(SystemExit):  # a knob measured and not adopted: no such flag
        flags("--scoring-seconds-overlap-credit", "2")
    with pytest.raises(ConfigError, match=r"scoring\.cost_model"):  # nor setting
        load_settings(None, {"scoring": {"cost_model": "seconds"}})


def test_worker_spec_with_event_endpoints() -> None:
    """The one worker-spec parser (index/ had a second one, used only by its tests)."""
    assert parse_worker_spec(
        "http://127.0.0.1:9001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558"
    ) == {
        "url": "http://127.0.0.1:9001",
        "events": "tcp://127.0.0.1:5557",
        "replay": "tcp://127.0.0.1:5558",
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_worker_spec("http://h:1,events")


def test_env_workers_as_words_or_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_WORKERS", "http://a:1 http://b:2,engine=openai")
    assert [w.engine for w in load_settings().workers] == ["vllm", "openai"]
    monkeypatch.setenv("KVGATE_WORKERS", '[{"url": "http://c:3", "models": ["m"]}]')
    assert load_settings().workers[0].models == ["m"]


@pytest.mark.parametrize(
    ("source", "field"),
    [
        ({"health": {"interval_s": "-1"}}, "health.interval_s"),
        ({"port": "http"}, "port"),
        ({"workers": ["ftp://nope"]}, "workers.0.url"),
        ({"workers": ["http://a:1,colour=red"]}, "workers.0"),
        ({"workers": [{"url": "http://a:1", "engine": "tgi"}]}, "workers.0.engine"),
        ({"workers": ["http://a:1", "http://a:1/"]}, "workers"),
        ({"policy": "fastest"}, "policy"),
        ({"upstream": {"max_failover": "-2"}}, "upstream.max_failover"),
        ({"log_level": "loud"}, "log_level"),
        ({"unknown_knob": 1}, "unknown_knob"),
    ],
)
def test_flag_errors_name_the_field(source: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"\n  {field}(\s|:)"):
        load_settings(None, source)


def test_env_and_yaml_errors_name_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGATE_HEALTH__TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match=r"health\.timeout_s"):
        load_settings()
    monkeypatch.delenv("KVGATE_HEALTH__TIMEOUT_S")
    with pytest.raises(ConfigError, match=r"upstream\.read_timeout_s"):
        load_settings(write(tmp_path, "upstream:\n  read_timeout_s: 0\n"))
    with pytest.raises(ConfigError, match="--config"):
        load_settings(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError):
        load_settings(write(tmp_path, "port: [unclosed\n"))


def test_secrets_never_appear_in_errors() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(None, {"workers": [{"url": "http://a:1", "api_key": ["sekrit"]}]})
    assert "sekrit" not in str(caught.value)
    settings = load_settings(
        None, {"workers": ["http://a:1,api_key=sekrit"], "admin_token": "tok-xyz"}
    )
    assert "sekrit" not in repr(settings) and "tok-xyz" not in repr(settings)


def test_serve_reports_bad_config_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve.main(["--port", "99999"]) == 2
    err = capsys.readouterr().err
    assert "port" in err and "99999" in err


def test_help_documents_every_knob(capsys: pytest.CaptureFixture[str]) -> None:
    """``--help-all``: every setting, with a flag or read only from the config file and the
    environment, with its variable."""
    with pytest.raises(SystemExit):
        serve.main(["--help-all"])
    text = capsys.readouterr().out
    for name, info in Settings.model_fields.items():
        assert (
            f"KVGATE_{name.upper()}" in text
            or name in {"health", "upstream", "client"}
            or (info.annotation is not None and "KVGATE_" in text)
        )
    for prefix, model in (
        ("health", "HealthConfig"),
        ("upstream", "UpstreamConfig"),
        ("client", "ClientConfig"),
    ):
        nested = Settings.model_fields[prefix].annotation
        assert nested is not None and nested.__name__ == model
        for name in nested.model_fields:
            flag = f"--{prefix}-{name.replace('_', '-')}"
            assert flag in text or f"KVGATE_{prefix.upper()}__{name.upper()}" in text
    assert "--worker" in text and "--sim" in text and "--config" in text
    assert "--worker-allow" in text


def test_help_lists_the_everyday_options_first_and_few(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """At most 60 options, in groups, the engines and the listener first; each with a help;
    a setting without a flag is still read from the environment and the config file."""
    with pytest.raises(SystemExit):
        serve.main(["--help"])
    text = capsys.readouterr().out
    options = [line.split()[0] for line in text.splitlines() if line.startswith("  --")]
    assert len(options) <= 60
    groups = [line for line in text.splitlines() if line and line[0].isalpha()]
    first = groups.index(next(g for g in groups if g.startswith("start here")))
    assert first < groups.index(next(g for g in groups if g.startswith("routing")))
    start = text.index("start here")
    for flag in ("--worker", "--tokenizer", "--host", "--port", "--sim"):
        assert start < text.index(f"  {flag} ") < text.index("routing:")
    for group in ("access", "capacity and queue", "engines", "observability"):
        assert any(g.startswith(group) for g in groups), group
    assert "--health-timeout-s" not in text and "--index-replay-max-s" not in text
    namespace = serve.build_parser().parse_args([])
    assert not given_settings(namespace, Settings)
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--health-timeout-s", "3"])


def test_settings_without_a_flag_keep_their_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_HEALTH__TIMEOUT_S", "3.5")
    monkeypatch.setenv("KVGATE_INDEX__REPLAY_MAX_S", "7")
    settings = load_settings()
    assert (settings.health.timeout_s, settings.index.replay_max_s) == (3.5, 7)


def test_kvgate_version(capsys: pytest.CaptureFixture[str]) -> None:
    from kvgate.router import cli  # noqa: PLC0415

    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("kvgate ") and out.split()[1] == cli.version()
