"""A tenant's Dockerfile, parsed as the builder reads it and checked before anything is built.

The builder runs on the host's engine: an `ADD <url>` is fetched by the daemon on the host network (whatever
`--network none` says), a `FROM` or `--from` of any image reads that image, `ONBUILD` plants instructions in a later
build, and a `# syntax=` directive pulls a frontend image. So every instruction is parsed (parser directives, escape
character, continuation lines and comments inside them) and:

- every stage's FROM, and every `COPY --from` / `RUN --mount=...,from=`, names an envfleet image (not another
  environment's, which may be another tenant's) or an earlier stage of the same file; no `$` substitution there;
- ADD takes no URL (nor a git address), COPY and ADD no path with `..`;
- ONBUILD, `# syntax=` and RUN flags other than `--mount` are refused;
- the final stage descends from an envfleet image (it must carry envd).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from orchestrator.core.echo import echo
from orchestrator.core.errors import InvalidRequestError

ENVFLEET_IMAGE_PREFIX = "envfleet/"
# the images of registered environments (orchestrator/service/declarative/env.py image_name): maybe another tenant's
TENANT_IMAGE_PREFIX = "envfleet/env-"
MAX_INSTRUCTIONS = 1000
_DIRECTIVE = re.compile(r"^#\s*([a-zA-Z][a-zA-Z0-9_-]*)\s*=\s*(.*?)\s*$")
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://|^git@", re.IGNORECASE)


class DockerfileError(InvalidRequestError):
    """The Dockerfile is refused; the message names the line and the rule."""


@dataclass(frozen=True)
class Instruction:
    """One logical instruction: its keyword (upper case), its arguments, and the line it starts on."""

    line: int
    keyword: str
    args: str


@dataclass
class _Stage:
    index: int
    name: str | None
    base: str  # an image, or the name/index of an earlier stage
    envfleet: bool  # descends from an envfleet image
    names: set[str] = field(default_factory=set)


def parse(text: str) -> list[Instruction]:
    """The logical instructions of a Dockerfile, continuation lines joined and comments dropped."""
    escape = "\\"
    lines = text.splitlines()
    start = 0
    # parser directives: only at the very top, before any comment, blank line or instruction
    for i, raw in enumerate(lines):
        m = _DIRECTIVE.match(raw.strip())
        if not m:
            break
        key, value = m.group(1).lower(), m.group(2)
        if key == "syntax":
            raise DockerfileError(f"line {i + 1}: '# syntax=' would pull a builder frontend image; remove it")
        if key == "escape":
            if value not in ("\\", "`"):
                raise DockerfileError(f"line {i + 1}: escape must be '\\' or '`', got {echo(value)}")
            escape = value
        start = i + 1
    out: list[Instruction] = []
    buf: list[str] = []
    first = 0
    for n in range(start, len(lines)):
        raw = lines[n]
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue  # comments vanish, even inside a continuation (as the builder does)
        if not buf:
            first = n + 1
        body = raw.rstrip()
        if body.endswith(escape) and not body.endswith(escape * 2):
            buf.append(body[:-1])
            continue
        buf.append(body)
        out.append(_instruction(first, " ".join(buf)))
        buf = []
        if len(out) > MAX_INSTRUCTIONS:
            raise DockerfileError(f"more than {MAX_INSTRUCTIONS} instructions")
    if buf:
        out.append(_instruction(first, " ".join(buf)))
    return out


def _instruction(line: int, text: str) -> Instruction:
    keyword, _, args = text.strip().partition(" ")
    return Instruction(line, keyword.upper(), args.strip())


def _flags(args: str) -> tuple[dict[str, list[str]], str]:
    """Leading `--name=value` flags and the rest."""
    flags: dict[str, list[str]] = {}
    rest = args
    while rest.startswith("--"):
        word, _, rest = rest.partition(" ")
        name, _, value = word[2:].partition("=")
        flags.setdefault(name.lower(), []).append(value)
        rest = rest.lstrip()
    return flags, rest


def _words(rest: str) -> list[str]:
    """The arguments of COPY/ADD: a JSON array, or words split on whitespace."""
    if rest.startswith("["):
        try:
            value = json.loads(rest)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    return rest.split()


def _image_allowed(ref: str) -> bool:
    return ref.startswith(ENVFLEET_IMAGE_PREFIX) and not ref.startswith(TENANT_IMAGE_PREFIX)


def check(text: str) -> None:
    """Refuse a Dockerfile that could reach outside its build (DockerfileError names the line and why)."""
    instructions = parse(text)
    froms = [i for i in instructions if i.keyword == "FROM"]
    if not froms:
        raise DockerfileError("the Dockerfile has no FROM line")
    stages: list[_Stage] = []

    def source(ref: str, line: int, what: str) -> bool:
        """Whether `ref` is an earlier stage (True: of envfleet descent) or an allowed image; raises otherwise."""
        if "$" in ref:
            raise DockerfileError(f"{what} {echo(ref)} (line {line}) uses a variable; name the image or stage")
        key = ref.lower()
        for s in stages:
            if key in s.names:
                return s.envfleet
        if _image_allowed(ref):
            return True
        why = "another environment's image" if ref.startswith(TENANT_IMAGE_PREFIX) else "not an envfleet image"
        raise DockerfileError(
            f"{what} {echo(ref)} (line {line}): {why}; use envfleet/base (or another envfleet image) or an earlier "
            "stage of this file"
        )

    for ins in instructions:
        kw, line = ins.keyword, ins.line
        if kw == "FROM":
            flags, rest = _flags(ins.args)
            words = rest.split()
            if not words or (len(words) not in (1, 3)) or (len(words) == 3 and words[1].lower() != "as"):
                raise DockerfileError(f"line {line}: FROM takes an image and an optional 'AS name'")
            base = words[0]
            envfleet = source(base, line, "the final stage is FROM" if ins is froms[-1] else "FROM")
            name = words[2].lower() if len(words) == 3 else None
            stage = _Stage(len(stages), name, base, envfleet, {str(len(stages))} | ({name} if name else set()))
            stages.append(stage)
        elif not stages and kw != "ARG":
            raise DockerfileError(f"line {line}: {kw} before the first FROM")
        elif kw == "ONBUILD":
            raise DockerfileError(f"line {line}: ONBUILD is not allowed (it would run in someone else's build)")
        elif kw in ("COPY", "ADD"):
            flags, rest = _flags(ins.args)
            for ref in flags.get("from", []):
                source(ref, line, f"{kw} --from")
            words = _words(rest)
            for src in words[:-1]:
                if kw == "ADD" and _URL.match(src):
                    raise DockerfileError(
                        f"line {line}: ADD {echo(src)}: the daemon would fetch it on the host network; "
                        "builds are offline, put the file in the image spec instead"
                    )
                if not flags.get("from") and ".." in PurePosixPath(src).parts:
                    raise DockerfileError(f"line {line}: {kw} source {echo(src)} leaves the build context")
        elif kw == "RUN":
            flags, _ = _flags(ins.args)
            for name, values in flags.items():
                if name != "mount":
                    raise DockerfileError(f"line {line}: RUN --{name} is not allowed")
                for value in values:
                    for part in value.split(","):
                        key, _, ref = part.partition("=")
                        if key.strip().lower() == "from":
                            source(ref.strip(), line, "RUN --mount from")
    final = stages[-1]
    if not final.envfleet:
        raise DockerfileError(
            f"the final stage is FROM {echo(final.base)}; it must be an envfleet image (e.g. envfleet/base:latest), "
            "which carries envd (builds are offline: nothing can be pulled)"
        )
