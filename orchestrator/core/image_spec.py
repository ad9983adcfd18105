"""ImageSpec: a small declarative image (base, files, commands, environment) and the Dockerfile it renders to."""

from __future__ import annotations

import json
import re
from pathlib import PurePosixPath

from pydantic import BaseModel, ConfigDict, Field, field_validator

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


_IMAGE_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")


# Dockerfile instructions substitute $VARS in paths and treat a backslash as an escape; allow neither in paths.
_PATH_FORBIDDEN = ("\n", "\r", "\0", "$", "\\")


class ImageSpec(BaseModel):
    """An image built FROM `base` (empty: envfleet's base image, built if need be): `files` (absolute path -> text)
    are copied in, then `run` commands run in order.

    `env` is set before the commands run and `workdir` is their working directory (and the image's).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    base: str = ""
    files: dict[str, str] = Field(default_factory=dict)
    run: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = None

    @field_validator("base")
    @classmethod
    def _check_base(cls, v: str) -> str:
        if v and not _IMAGE_REF.match(v):
            raise ValueError(f"base {v!r} is not an image reference")
        return v

    @field_validator("files")
    @classmethod
    def _check_files(cls, v: dict[str, str]) -> dict[str, str]:
        for path in v:
            _check_image_path(path, "file path")
        return v

    @field_validator("workdir")
    @classmethod
    def _check_workdir(cls, v: str | None) -> str | None:
        return None if v is None else _check_image_path(v, "workdir")

    @field_validator("env")
    @classmethod
    def _check_env(cls, v: dict[str, str]) -> dict[str, str]:
        for name, value in v.items():
            if not _ENV_NAME.match(name):
                raise ValueError(f"env name {name!r} is not a shell variable name")
            if "\n" in value or "\r" in value or "\0" in value:
                raise ValueError(f"env {name} holds a newline or NUL")
        return v

    @field_validator("run")
    @classmethod
    def _check_run(cls, v: list[str]) -> list[str]:
        for cmd in v:
            if not cmd.strip() or "\0" in cmd:
                raise ValueError(f"run command {cmd!r} is empty or holds NUL")
        return v


def _check_image_path(path: str, what: str) -> str:
    p = PurePosixPath(path)
    if not p.is_absolute():
        raise ValueError(f"{what} {path!r} must be absolute")
    if ".." in p.parts:
        raise ValueError(f"{what} {path!r} must not contain '..'")
    if path.endswith("/") and what == "file path":
        raise ValueError(f"{what} {path!r} must name a file, not a folder")
    if str(p) == "/" and what == "file path":
        raise ValueError(f"{what} {path!r} must name a file")
    if any(c in path for c in _PATH_FORBIDDEN):
        raise ValueError(f"{what} {path!r} must not contain '$', a backslash, a newline or NUL")
    return path


def render_dockerfile(spec: ImageSpec) -> tuple[str, dict[str, bytes]]:
    """The Dockerfile for `spec` and its build context (relative path -> bytes, Dockerfile excluded)."""
    if not spec.base:
        raise ValueError("an ImageSpec's base is given before it is rendered (ImageResolver puts the base image's in)")
    lines = [f"FROM {spec.base}"]
    lines += [f'ENV {name}="{_env_quote(value)}"' for name, value in spec.env.items()]
    if spec.workdir is not None:
        lines.append(f"WORKDIR {spec.workdir}")
    context: dict[str, bytes] = {}
    for i, (path, text) in enumerate(spec.files.items()):
        # named by its place, not its path: the builder reads *, ? and [ in a COPY source as a pattern, and a file
        # /opt/[a] got the bytes of /opt/a
        rel = f"files/{i}"
        context[rel] = text.encode()
        lines.append(f"COPY {json.dumps([rel, path])}")
    for cmd in spec.run:
        lines.append(f"RUN {cmd}" if shell_form(cmd) else f"RUN {json.dumps(['/bin/sh', '-c', cmd])}")
    return "\n".join(lines) + "\n", context


def shell_form(cmd: str) -> bool:
    """Whether a RUN command goes into the Dockerfile as written (one line); else as JSON (exec form), where the
    builder reads no flag, continuation or heredoc of it."""
    return "\n" not in cmd and "\r" not in cmd and not cmd.rstrip().endswith("\\")


def _env_quote(value: str) -> str:
    """Quote for a Dockerfile ENV double-quoted word: backslash, quote and '$' (no variable substitution)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")
