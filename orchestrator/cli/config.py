"""Command-line options from the environment or a config file: every option of the top-level parser and of the
commands named in `CONFIGURABLE_COMMANDS` (`serve`) also reads `ENVFLEET_<DEST>` and the key `<dest>` of
`--config FILE` (YAML or TOML; `$ENVFLEET_CONFIG` names one too).

A repeatable option takes a list in the file and comma-separated values in its variable. Precedence: command line >
environment > file > the flag's default. The mechanism walks the parser's actions, so a
flag added later gets its variable and its key without a line here. A key whose value is null (YAML `~`) is not set:
the variable or the flag's default stands (read as text, it was the string "None": a data dir named None, tracing
to an endpoint named None).

The server's settings that no flag sets (`SERVE_SECTIONS`: caps, capacity, pool, ...) are keys of the file too,
nested as the server configuration's own fields (`caps: {jobs_per_tenant: 64}`); they land in `args.settings` for
`serve` to validate (pydantic names a bad field), and have no variable.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import yaml

ENV_PREFIX = "ENVFLEET_"
CONFIG_ENV = "ENVFLEET_CONFIG"
CONFIG_FLAG = "--config"
CONFIGURABLE_COMMANDS = ("serve",)
# the server configuration's fields (OrchestratorConfig) that no serve flag sets: the file's keys only
SERVE_SECTIONS = (
    "caps",
    "capacity",
    "pool",
    "sandboxes",
    "sessions",
    "environments",
    "max_message_bytes",
    "client_keepalive_s",
    "worker_heartbeat_timeout_s",
)
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NOT_SETTABLE = (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)


def envfleet_version() -> str:
    """The installed distribution's version (what `envfleet --version` prints)."""
    try:
        return version("envfleet")
    except PackageNotFoundError:
        return "unknown (not installed as a distribution)"


def add_version_argument(p: argparse.ArgumentParser) -> None:
    """`--version`, from the distribution's metadata."""
    p.add_argument("--version", action="version", version=f"%(prog)s {envfleet_version()}")


def add_config_argument(p: argparse.ArgumentParser) -> None:
    """`--config FILE` on a configurable command."""
    p.add_argument(
        CONFIG_FLAG,
        metavar="FILE",
        default=None,
        help=f"YAML or TOML file of this command's options (keys as the flags' names; default ${CONFIG_ENV}); "
        f"each option also reads {ENV_PREFIX}<NAME>; the command line wins over the environment over the file",
    )


def settable_actions(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options of `p` that a variable or a file key may set (not --help, --version, --config, subcommands)."""
    return [
        a
        for a in p._actions
        if a.option_strings and not isinstance(a, _NOT_SETTABLE) and a.dest != CONFIG_FLAG.lstrip("-")
    ]


def env_name(action: argparse.Action) -> str:
    """The environment variable of an option: `--data-dir` is ENVFLEET_DATA_DIR."""
    return ENV_PREFIX + action.dest.upper()


def subcommand_parsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parsers of `p`'s subcommands, by name."""
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def parse_args(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> argparse.Namespace:
    """`parser.parse_args(argv)` with the defaults of the top-level and configurable commands' options taken from
    the config file, then the environment. A bad value or an unknown file key is a usage error (exit 2)."""
    args = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if environ is None else environ
    commands = subcommand_parsers(parser)
    targets = [parser, *(commands[c] for c in CONFIGURABLE_COMMANDS if c in commands)]
    config_path = _config_path(args, env)
    command = _command_of(parser, args)
    # $ENVFLEET_CONFIG is the server's (a host's setting): a file of it that another command cannot read broke every
    # command (`envfleet jobs` exited with serve's usage), whose only use of it is the top-level options
    optional = command not in CONFIGURABLE_COMMANDS and _config_path(args, {}) is None
    file_values = _read_config(config_path, targets, optional=optional) if config_path else {}
    settings = {k: file_values.pop(k) for k in SERVE_SECTIONS if k in file_values}
    # argparse adds a repeatable (append) or counted option's command-line values to its default: taken as defaults,
    # the file's and the environment's would have stayed, and `--allow-policy-url https://only/` on the command line
    # still let an ENVFLEET_ALLOW_POLICY_URL=http:// through. They stand in after the parse, where the command line
    # gave none.
    added: dict[str, tuple[str, argparse.Action, Any]] = {}
    for target in targets:
        if target is not parser and (command is None or commands[command] is not target):
            continue  # another command's options: its variables, bad or not, are not this command's concern
        defaults: dict[str, Any] = {}
        for action in settable_actions(target):
            if action.dest in file_values:
                defaults[action.dest] = _convert(target, action, file_values[action.dest], f"{config_path}")
            raw = env.get(env_name(action))
            if raw is not None and raw != "":
                defaults[action.dest] = _convert(target, action, raw, f"${env_name(action)}")
            if action.dest in defaults and isinstance(action, argparse._AppendAction | argparse._CountAction):
                added[action.dest] = (target.prog, action, defaults.pop(action.dest))
        target.set_defaults(**defaults)
    namespace = parser.parse_args(args)
    chosen = {
        parser.prog,
        *(commands[c].prog for c in CONFIGURABLE_COMMANDS if getattr(namespace, "command", None) == c),
    }
    for dest, (prog, action, value) in added.items():
        if prog in chosen and getattr(namespace, dest, action.default) == action.default:
            setattr(namespace, dest, value)
    namespace.settings = settings
    return namespace


def _command_of(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The subcommand the command line names: its first word that is no option nor an option's value."""
    takes_value = {o for a in parser._actions if a.nargs != 0 for o in a.option_strings}
    commands = subcommand_parsers(parser)
    skip = False
    for token in argv:
        if skip:
            skip = False
        elif token in takes_value:
            skip = True
        elif not token.startswith("-"):
            return token if token in commands else None
    return None


def _config_path(argv: list[str], env: Mapping[str, str]) -> Path | None:
    """The last --config of the command line (argparse keeps the last too), else $ENVFLEET_CONFIG. The configurable
    parsers take no abbreviation (build_parser): a `--conf FILE` was --config to argparse, and no file was read."""
    found: Path | None = None
    for i, token in enumerate(argv):
        if token == "--":
            break
        if token == CONFIG_FLAG and i + 1 < len(argv):
            found = Path(argv[i + 1])
        elif token.startswith(CONFIG_FLAG + "="):
            found = Path(token.split("=", 1)[1])
    if found is not None:
        return found
    return Path(env[CONFIG_ENV]) if env.get(CONFIG_ENV) else None


def _read_config(path: Path, targets: list[argparse.ArgumentParser], *, optional: bool = False) -> dict[str, Any]:
    """The file's values; a usage error when it cannot be read, unless `optional` (then none)."""
    where = targets[-1]
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        if optional:
            return {}
        where.error(f"cannot read the config file {path}: {e.strerror or e}")
    try:
        loaded = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        where.error(f"config file {path} is not valid {'TOML' if path.suffix == '.toml' else 'YAML'}: {e}")
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        where.error(f"config file {path} must be a mapping of option names to values")
    known = {a.dest for t in targets for a in settable_actions(t)} | set(SERVE_SECTIONS)
    values: dict[str, Any] = {}
    for key, value in loaded.items():
        dest = str(key).replace("-", "_")
        if dest not in known:
            where.error(f"config file {path}: unknown key {key!r} (known: {', '.join(sorted(known))})")
        if value is not None:
            values[dest] = value
    return values


def _convert(p: argparse.ArgumentParser, action: argparse.Action, value: Any, source: str) -> Any:
    """A file's or a variable's value as the parser would have made it from the command line."""
    if isinstance(action, argparse._CountAction):
        return _typed(p, int, value, source)
    if action.nargs == 0:  # a switch: the value is the option's own (true or false), whichever flag sets it
        flag = value if isinstance(value, bool) else str(value).strip().lower()
        if flag not in _TRUE | _FALSE | {True, False}:
            p.error(f"{source}={value!r}: expected one of {', '.join(sorted(_TRUE | _FALSE))}")
        on = flag is True or flag in _TRUE
        if isinstance(action, argparse._StoreConstAction) and not isinstance(action.const, bool):
            return action.const if on else action.default
        return on
    if action.nargs in ("*", "+") or isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [v for v in str(value).split(",") if v]
        return [_one(p, action, v, source) for v in items]
    return _one(p, action, value, source)


def _one(p: argparse.ArgumentParser, action: argparse.Action, value: Any, source: str) -> Any:
    converted = _typed(p, action.type, value, source) if callable(action.type) else str(value)
    if action.choices is not None and converted not in action.choices:
        p.error(f"{source}={value!r}: invalid choice (choose from {', '.join(map(str, action.choices))})")
    return converted


def _typed(p: argparse.ArgumentParser, kind: Any, value: Any, source: str) -> Any:
    try:
        return kind(str(value))
    except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
        p.error(f"{source}={value!r}: invalid {getattr(kind, '__name__', 'value')} value ({e})")
