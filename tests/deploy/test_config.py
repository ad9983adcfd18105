"""`envfleet serve` configured by ENVFLEET_* variables and a YAML or TOML file, generically over the parser; and the
JSON log lines of --log-format json."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from orchestrator.cli.config import SERVE_SECTIONS, env_name, parse_args, settable_actions, subcommand_parsers
from orchestrator.cli.healthcheck import default_address
from orchestrator.cli.log_format import JsonFormatter, configure_logging
from orchestrator.cli.main import _server_config, build_parser
from orchestrator.core.errors import ConfigError
from orchestrator.server.app import OrchestratorConfig
from orchestrator.server.convert import validation_message


def _serve() -> argparse.ArgumentParser:
    return subcommand_parsers(build_parser())["serve"]


def _sample(action: argparse.Action) -> tuple[Any, Any]:
    """A value for the option other than its default where it has one: (as written in a variable, as parsed)."""
    if isinstance(action, argparse._CountAction):
        return "2", 2
    if action.nargs == 0:
        want = not bool(action.default)
        return ("yes" if want else "off"), want
    _, item = _sample_item(action, None)
    if isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+"):
        return f"{item},{item}", [item, item]  # a list: comma-separated in a variable
    return _sample_item(action, action.default)


def _sample_item(action: argparse.Action, default: Any) -> tuple[Any, Any]:
    if action.choices:
        choice = next((c for c in action.choices if c != default), next(iter(action.choices)))
        return str(choice), choice
    if action.type is int:
        return "7", 7
    if action.type is float:
        return "2.5", 2.5
    if action.type is Path:
        return "/srv/envfleet/x", Path("/srv/envfleet/x")
    if action.type is None:
        return "some-value", "some-value"
    raise AssertionError(f"no sample value for --{action.dest} of type {action.type}: add one here")


def _options() -> list[argparse.Action]:
    return [*settable_actions(build_parser()), *settable_actions(_serve())]


def test_every_serve_flag_has_a_variable() -> None:
    actions = settable_actions(_serve())
    flags = {a.option_strings[0] for a in actions}
    assert {"--port", "--data-dir", "--socket-root", "--token-file", "--reflection"} <= flags  # the walk finds them
    for action in _options():
        raw, parsed = _sample(action)
        args = parse_args(build_parser(), ["serve"], environ={env_name(action): raw})
        assert getattr(args, action.dest) == parsed, (env_name(action), raw)


@pytest.mark.parametrize("suffix", [".yaml", ".toml"])
def test_every_serve_flag_has_a_config_key(tmp_path: Path, suffix: str) -> None:
    values = {a.dest: _sample(a) for a in _options()}
    path = tmp_path / f"envfleet{suffix}"
    if suffix == ".toml":
        # flag spelling for the keys, native TOML values (a string where the sample is a path)
        path.write_text(
            "\n".join(f"{d.replace('_', '-')} = {json.dumps(p, default=str)}" for d, (_, p) in values.items())
        )
    else:
        path.write_text("\n".join(f"{d}: {json.dumps(raw)}" for d, (raw, _) in values.items()))
    args = parse_args(build_parser(), ["serve", "--config", str(path)], environ={})
    for dest, (_, parsed) in values.items():
        assert getattr(args, dest) == parsed, dest


def test_command_line_wins_over_environment_over_file_over_default(tmp_path: Path) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text("port: 1001\nmax-in-flight: 5\n")
    env = {"ENVFLEET_PORT": "1002", "ENVFLEET_CONFIG": str(conf)}
    assert parse_args(build_parser(), ["serve", "--port", "1003"], environ=env).port == 1003
    assert parse_args(build_parser(), ["serve"], environ=env).port == 1002
    assert parse_args(build_parser(), ["serve"], environ={"ENVFLEET_CONFIG": str(conf)}).port == 1001
    assert parse_args(build_parser(), ["serve"], environ={}).port == 50051
    # the file's other key holds, and --config on the command line names the file as well as the variable does
    assert parse_args(build_parser(), ["serve", f"--config={conf}"], environ={}).max_in_flight == 5


def test_a_repeatable_option_on_the_command_line_replaces_the_environments_and_the_files(tmp_path: Path) -> None:
    # argparse adds a repeatable option's values to its default: the operator who narrowed the policy allowlist on
    # the command line still let ENVFLEET_ALLOW_POLICY_URL's http:// through, and -v counted on from ENVFLEET_VERBOSE
    conf = tmp_path / "c.yaml"
    conf.write_text("allow-policy-url: [https://file.example/]\n")
    env = {"ENVFLEET_ALLOW_POLICY_URL": "http://", "ENVFLEET_VERBOSE": "2"}
    args = parse_args(build_parser(), ["-v", "serve", "--allow-policy-url", "https://only.example/"], environ=env)
    assert (args.allow_policy_url, args.verbose) == (["https://only.example/"], 1)
    args = parse_args(build_parser(), ["serve"], environ=env)
    assert (args.allow_policy_url, args.verbose) == (["http://"], 2)
    args = parse_args(build_parser(), ["serve", "--config", str(conf)], environ={})
    assert args.allow_policy_url == ["https://file.example/"]
    args = parse_args(build_parser(), ["serve", "--config", str(conf), "--allow-policy-url", "https://x/"], environ={})
    assert args.allow_policy_url == ["https://x/"]


@pytest.mark.parametrize(
    ("environ", "error"),
    [
        ({"ENVFLEET_PORT": "fifty"}, "$ENVFLEET_PORT='fifty': invalid int value"),
        ({"ENVFLEET_BACKEND": "podman"}, "$ENVFLEET_BACKEND='podman': invalid choice (choose from docker"),
        ({"ENVFLEET_INSECURE": "maybe"}, "$ENVFLEET_INSECURE='maybe': expected one of"),
        ({"ENVFLEET_LOG_FORMAT": "xml"}, "$ENVFLEET_LOG_FORMAT='xml': invalid choice"),
    ],
)
def test_a_bad_variable_is_a_usage_error(
    environ: dict[str, str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(build_parser(), ["serve"], environ=environ)
    assert e.value.code == 2
    assert error in capsys.readouterr().err


def test_a_bad_config_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    conf = tmp_path / "c.yaml"
    conf.write_text("prot: 50051\n")
    with pytest.raises(SystemExit):
        parse_args(build_parser(), ["serve", "--config", str(conf)], environ={})
    assert f"config file {conf}: unknown key 'prot' (known: " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(build_parser(), ["serve", "--config", str(tmp_path / "missing.toml")], environ={})
    assert "cannot read the config file" in capsys.readouterr().err
    conf.write_text("- a list\n")
    with pytest.raises(SystemExit):
        parse_args(build_parser(), ["serve"], environ={"ENVFLEET_CONFIG": str(conf)})
    assert "must be a mapping of option names to values" in capsys.readouterr().err


def test_other_commands_ignore_the_variables() -> None:
    args = parse_args(build_parser(), ["scripted-policy", "--env", "python-tool"], environ={"ENVFLEET_PORT": "9"})
    assert args.port == 0


def test_json_log_lines(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(1, "json")
    try:
        log = logging.getLogger("envfleet.test")
        log.info("job %s done", "j1", extra={"job_id": "j1"})
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    finally:
        configure_logging(0, "text")
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert lines[0]["message"] == "job j1 done" and lines[0]["job_id"] == "j1"
    assert lines[0]["level"] == "INFO" and lines[0]["logger"] == "envfleet.test"
    assert lines[0]["time"].endswith("+00:00")
    assert lines[1]["level"] == "ERROR" and "ValueError: boom" in lines[1]["exception"]
    assert JsonFormatter().format(logging.makeLogRecord({"msg": "a\nb"})).count("\n") == 0


def test_probe_address_follows_the_server_variables() -> None:
    assert default_address({}) == "127.0.0.1:50051"
    assert default_address({"ENVFLEET_HOST": "0.0.0.0", "ENVFLEET_PORT": "6000"}) == "127.0.0.1:6000"
    assert default_address({"ENVFLEET_HOST": "::1"}) == "[::1]:50051"


def test_tokenizer_directories_from_flags_and_the_config_file(tmp_path: Path) -> None:
    from orchestrator.cli.main import _server_config
    from orchestrator.server.app import OrchestratorConfig

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (tmp_path / "serve.yaml").write_text(f"tokenizer_dir: [{a}, {b}]\n")
    args = parse_args(build_parser(), ["serve", "--config", str(tmp_path / "serve.yaml"), "--workers", "0"], {})
    config = _server_config(args)
    assert isinstance(config, OrchestratorConfig) and config.tokenizer_dirs == [a, b]
    args = parse_args(build_parser(), ["serve", "--tokenizer-dir", str(b), "--workers", "0"], {})
    assert _server_config(args).tokenizer_dirs == [b]  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="tokenizer_dirs: not a directory"):
        _server_config(parse_args(build_parser(), ["serve", "--tokenizer-dir", str(tmp_path / "none")], {}))


def test_the_servers_settings_no_flag_sets_come_from_the_config_file(tmp_path: Path) -> None:
    # the caps a refusal names (caps.jobs_per_tenant ...), the capacity, the pools, sessions' and sandboxes' own caps:
    # the README said `caps:` in the server config, and `envfleet serve` had no way to set any of them
    conf = tmp_path / "c.yaml"
    conf.write_text(
        "caps: {jobs_per_tenant: 7, sandbox: {cpus: 2}}\n"
        "capacity: {max_sandboxes: 9}\n"
        "sessions: {max_per_tenant: 3}\n"
        "sandboxes: {max_per_tenant: 4}\n"
        "pool: {enabled: false}\n"
        "environments: ['environments.python_tool:PythonToolEnv']\n"
        "client-keepalive-s: 30\n"
        "session-ttl: 120\n"
    )
    args = parse_args(build_parser(), ["serve", "--backend", "fake", "--config", str(conf)], environ={})
    config = _server_config(args)
    assert isinstance(config, OrchestratorConfig)
    assert (config.caps.jobs_per_tenant, config.caps.sandbox.cpus, config.capacity.max_sandboxes) == (7, 2, 9)
    assert (config.sessions.max_per_tenant, config.sessions.idle_ttl_s, config.sandboxes.max_per_tenant) == (3, 120, 4)
    assert not config.pool.enabled and config.client_keepalive_s == 30
    assert config.environments == ["environments.python_tool:PythonToolEnv"]
    # every section is a field of the server's configuration, and none is a flag's
    flags = {a.dest for a in settable_actions(_serve())}
    assert set(SERVE_SECTIONS) <= set(OrchestratorConfig.model_fields) and not set(SERVE_SECTIONS) & flags

    conf.write_text("caps: {jobs_per_tenant: -1}\n")
    args = parse_args(build_parser(), ["serve", "--backend", "fake", "--config", str(conf)], environ={})
    with pytest.raises(ValidationError) as bad:
        _server_config(args)
    assert "caps.jobs_per_tenant" in validation_message(bad.value)
    conf.write_text("sessions: {idle_ttl_s: 5}\n")
    args = parse_args(build_parser(), ["serve", "--backend", "fake", "--config", str(conf)], environ={})
    with pytest.raises(ConfigError, match="set it with session-ttl"):
        _server_config(args)


def test_the_config_flag_is_read_whole_and_last(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first, last = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("port: 1001\n")
    last.write_text("port: 1002\n")
    # argparse kept the last --config, the file was read from the first
    assert parse_args(build_parser(), ["serve", "--config", str(first), "--config", str(last)], environ={}).port == 1002
    # an abbreviation was --config to argparse, yet no file was read: now it is no option at all
    with pytest.raises(SystemExit) as e:
        parse_args(build_parser(), ["serve", "--conf", str(first)], environ={})
    assert e.value.code == 2 and "unrecognized arguments: --conf" in capsys.readouterr().err


def test_a_null_in_the_config_file_leaves_the_option_unset(tmp_path: Path) -> None:
    # read as text, `data-dir: ~` was a result log in ./None, `otlp-endpoint: ~` traces sent to an endpoint "None"
    conf = tmp_path / "c.yaml"
    conf.write_text("data-dir: ~\notlp-endpoint: null\nray-address: ~\nport: 1003\ncaps: ~\n")
    args = parse_args(build_parser(), ["serve", "--config", str(conf)], environ={"ENVFLEET_PORT": ""})
    assert (args.data_dir, args.otlp_endpoint, args.ray_address, args.port) == (".envfleet", None, None, 1003)
    assert args.settings == {}


def test_a_bad_envd_choice_in_the_environment_is_one_line_not_a_traceback() -> None:
    # $ENVFLEET_ENVD was read when the module loaded, into a default every config shared: a typo was a pydantic
    # traceback of any command that made a docker backend's config (serve, sweep, envs validate)
    r = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "sweep"],
        env={**os.environ, "ENVFLEET_ENVD": "Python"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "$ENVFLEET_ENVD='Python': expected go or python" in r.stderr


def test_another_commands_bad_variable_or_key_is_not_this_commands_error(tmp_path: Path) -> None:
    # serve's variables and file were read and checked for every command: ENVFLEET_PORT=abc made `envfleet jobs`
    # fail with "envfleet serve: error"
    conf = tmp_path / "c.yaml"
    conf.write_text("port: fifty\nlog-format: json\n")
    env = {"ENVFLEET_PORT": "abc", "ENVFLEET_CONFIG": str(conf)}
    args = parse_args(build_parser(), ["-v", "jobs"], environ=env)
    assert args.command == "jobs" and args.log_format == "json"  # the top level's options still come from both
    with pytest.raises(SystemExit):
        parse_args(build_parser(), ["serve"], environ=env)


def test_an_unreadable_config_of_the_environment_fails_serve_only(tmp_path: Path) -> None:
    # $ENVFLEET_CONFIG is the server host's: a file of it that could not be read broke every command (`envfleet jobs`
    # exited with serve's usage error), though only serve reads its settings
    environ = {"ENVFLEET_CONFIG": str(tmp_path / "nope.yaml")}
    args = parse_args(build_parser(), ["jobs", "--server", "127.0.0.1:1"], environ)
    assert args.server == "127.0.0.1:1"
    with pytest.raises(SystemExit) as e:
        parse_args(build_parser(), ["serve"], environ)
    assert e.value.code == 2
    (tmp_path / "log.yaml").write_text("log_format: json\n")  # a readable one still sets the top-level options
    args = parse_args(build_parser(), ["jobs"], {"ENVFLEET_CONFIG": str(tmp_path / "log.yaml")})
    assert args.log_format == "json"
