"""A tenant's Dockerfile, parsed as the builder reads it and checked before anything is built.

The builder runs on the host's engine: an `ADD <url>` is fetched by the daemon on the host network (whatever
`--network none` says), a `FROM` or `--from` of any image reads that image, `ONBUILD` plants instructions in a later
build, a `# syntax=` directive pulls a frontend image, and a `VOLUME` gives every sandbox of the image a writable
engine volume outside its read-only root and tmpfs caps. So the file is read the way buildkit's parser (vendored by
the engine's classic builder) reads it: lines split on `\n` alone; a line continues only when it ends with the escape
character and then spaces and tabs (`\\[ \t]*$`); comment and blank lines inside a continuation are dropped and the
pieces joined with nothing between them; the keyword is split from its arguments on `[\t\v\f\r ]+` after a trim of
Go's Unicode whitespace. Where engines differ, or a line could be read two ways, the file is refused rather than
guessed at: a keyword that is not an instruction, a `\r` inside a line, an escape followed by other invisible
characters, a doubled escape at a line's end (older engines continue the line, newer ones do not), an escape
directive anywhere but the first line, a heredoc (newer engines take its body as data). Then:

- every stage's FROM, and every `COPY --from` / `RUN --mount=...,from=`, names an envfleet image (not another
  environment's, which may be another tenant's) or an earlier stage of the same file, written plainly (no variable,
  quote or escape: the builder expands those), and FROM takes no `--platform` (an image of another platform would be
  pulled); `check` returns the images named, which the build requires on the host (the engine pulls a missing one
  over the host network, whatever `--network none` says);
- flags are written `--name=value`, without quotes, backslashes or non-ASCII characters (the builder unquotes flags,
  and splits them on bytes);
- ADD takes no URL (nor a git address) and no source the builder would expand; COPY and ADD no path with `..`;
- ONBUILD, VOLUME, `# syntax=` and RUN flags other than `--mount` are refused, and so are the final stage's
  ENTRYPOINT and HEALTHCHECK, which a sandbox never runs;
- the final stage descends from an envfleet image (it must carry envd).
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from orchestrator.core.echo import echo
from orchestrator.core.errors import InvalidRequestError

ENVFLEET_IMAGE_PREFIX = "envfleet/"
# the images of registered environments (orchestrator/service/declarative/env.py image_name): maybe another tenant's
TENANT_IMAGE_PREFIX = "envfleet/env-"
MAX_INSTRUCTIONS = 1000
# the instructions the builder knows (buildkit's parser dispatch table); it fails on any other keyword
_INSTRUCTIONS = frozenset(
    {
        *("ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL", "MAINTAINER"),
        *("ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"),
    }
)
# Go's unicode.IsSpace, which the parser trims with (Python's str.isspace adds \x1c-\x1f)
_GO_SPACE = "\t\n\v\f\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
_SEPARATOR = re.compile(r"[\t\v\f\r ]+")  # between keyword and arguments, and between whitespace-delimited words
_ESCAPE_DIRECTIVE = re.compile(r"^#[ \t]*escape[ \t]*=[ \t]*([\\`])[ \t]*$", re.IGNORECASE)
# anything a parser of any version may take for an escape or syntax directive (Unicode whitespace, any case)
_LOOSE_DIRECTIVE = re.compile(r"^#\s*(escape|syntax)\s*=", re.IGNORECASE)
_FLAG = re.compile(r"^--([a-z][a-z0-9-]*)=([^\x00-\x20\x7f-\U0010ffff'\"\\]*)$")  # printable ASCII, unquoted
_PLAIN_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")
# a word newer builders take as a heredoc's start (buildkit: `<<EOF`, `<<-EOF`, `2<<"EOF"`; not `<<<`, not `1 << 4`)
_HEREDOC = re.compile(r"^\d*<<-?[\"']?[A-Za-z]")
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://|^git@", re.IGNORECASE)
_EXPANDED = set("$'\"\\`")  # the builder's shell-word processing acts on these in ADD sources


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


def _invisible(c: str) -> bool:
    """Whitespace to Python or Go, or a control, format or separator character: what a reader cannot see."""
    return c.isspace() or c in _GO_SPACE or unicodedata.category(c)[0] in "CZ"


def _lines(text: str) -> list[str]:
    """The file's lines as the parser's scanner cuts them: on \n alone, one \r before it dropped, a BOM dropped."""
    lines = text.removeprefix("\ufeff").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    out = []
    for n, raw in enumerate(lines, 1):
        line = raw.removesuffix("\r")
        if "\r" in line:
            # older parsers drop one \r before the \n, newer ones every \r at the end; and \r separates words
            raise DockerfileError(f"line {n}: a carriage return inside the line; end lines with \\n or \\r\\n only")
        out.append(line)
    return out


def _directives(lines: list[str]) -> str:
    """The escape character, after refusing every directive but an escape directive on the first line."""
    escape = "\\"
    for n, line in enumerate(lines, 1):
        m = _LOOSE_DIRECTIVE.match(line.lstrip(_GO_SPACE))
        if not m:
            continue
        if m.group(1).lower() == "syntax":
            raise DockerfileError(f"line {n}: '# syntax=' would pull a builder frontend image; remove it")
        exact = _ESCAPE_DIRECTIVE.match(line)
        if n != 1 or not exact:
            raise DockerfileError(
                f"line {n}: an escape directive is honoured only as the first line, written exactly '# escape=`' "
                "or '# escape=\\' (builders disagree on any other form or place); move it or remove it"
            )
        escape = exact.group(1)
    return escape


def _continues(line: str, n: int, escape: str) -> tuple[bool, str]:
    """Whether the line continues on the next one (the builder's `E[ \t]*$`), and the line without the escape."""
    m = re.search(f"({re.escape(escape)}+)[ \t]*$", line)
    if m:
        if len(m.group(1)) > 1:
            raise DockerfileError(
                f"line {n} ends with more than one escape character {escape!r}; older builders continue such a "
                "line and newer ones do not: rewrite its end"
            )
        return True, line[: m.start()]
    visible = line
    while visible and _invisible(visible[-1]):
        visible = visible[:-1]
    if visible.endswith(escape):
        raise DockerfileError(
            f"line {n}: the escape character {escape!r} at its end is followed by {echo(line[len(visible) :])}, so "
            "it is not a line continuation to the builder; remove the characters after it"
        )
    return False, line


def adds(text: str) -> bool:
    """Whether a Dockerfile has an ADD (or ONBUILD ADD), read as the builder reads it: a keyword split by a
    continuation (`AD\\` then `D`) is joined with nothing between, and `# escape=` may change the continuation.
    One that could be read more than one way counts as adding."""
    try:
        instructions = parse(text)
    except DockerfileError:
        return True
    return any(
        i.keyword == "ADD" or (i.keyword == "ONBUILD" and i.args.lstrip().upper().startswith("ADD"))
        for i in instructions
    )


def parse(text: str) -> list[Instruction]:
    """The logical instructions of a Dockerfile, as the builder's parser cuts them: continuation lines joined and
    comments dropped (DockerfileError where the file could be read more than one way)."""
    lines = _lines(text)
    escape = _directives(lines)
    out: list[Instruction] = []
    n = 0
    while n < len(lines):
        first = n + 1
        head = lines[n].lstrip(_GO_SPACE)
        n += 1
        if not head or head.startswith("#"):
            continue  # a blank line or a comment (the directive above is a comment too)
        more, body = _continues(head, first, escape)
        pieces = [body]
        while more and n < len(lines):
            raw = lines[n]
            n += 1
            stripped = raw.lstrip(_GO_SPACE)
            if not stripped or stripped.startswith("#"):
                continue  # comments and blank lines inside a continuation vanish, as the builder drops them
            more, body = _continues(raw, n, escape)
            pieces.append(body)  # joined with nothing between, as the builder does
        if more:
            # whatever is appended to the file (Harbor's image tail) would join this instruction
            raise DockerfileError(
                f"its last instruction (line {first}) continues past the end of the file; remove the escape "
                "character at its end"
            )
        out.append(_instruction(first, "".join(pieces)))
        if len(out) > MAX_INSTRUCTIONS:
            raise DockerfileError(f"more than {MAX_INSTRUCTIONS} instructions")
    return out


def _instruction(line: int, text: str) -> Instruction:
    keyword, *rest = _SEPARATOR.split(text.strip(_GO_SPACE), maxsplit=1)
    if keyword.upper() not in _INSTRUCTIONS:
        raise DockerfileError(
            f"line {line}: {echo(keyword)} is not a Dockerfile instruction; separate the instruction from its "
            "arguments with a space"
        )
    return Instruction(line, keyword.upper(), rest[0].strip(_GO_SPACE) if rest else "")


def _flags(args: str, line: int) -> tuple[dict[str, list[str]], str]:
    """Leading `--name=value` flags and the rest; anything the builder's flag parser would unquote, unescape or
    split differently is refused."""
    flags: dict[str, list[str]] = {}
    rest = args
    while rest.startswith("--"):
        word, *tail = re.split(r"[\t\n\v\f\r ]+", rest, maxsplit=1)
        m = _FLAG.match(word)
        if not m:
            raise DockerfileError(
                f"line {line}: flag {echo(word)}: write flags as --name=value, without quotes, backslashes or "
                "non-ASCII characters"
            )
        flags.setdefault(m.group(1), []).append(m.group(2))
        rest = tail[0].lstrip(_GO_SPACE) if tail else ""
    return flags, rest


def _words(rest: str) -> list[str]:
    """The arguments of COPY/ADD: a JSON array of strings, or words split on the builder's separators."""
    if rest.startswith("["):
        try:
            value = json.loads(rest)
        except (ValueError, RecursionError):  # not JSON (or nested past Python's limit): the builder splits it
            value = None
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    return [w for w in _SEPARATOR.split(rest) if w]


def _image_allowed(ref: str) -> bool:
    return ref.startswith(ENVFLEET_IMAGE_PREFIX) and not ref.startswith(TENANT_IMAGE_PREFIX)


def check(text: str) -> list[str]:
    """Refuse a Dockerfile that could reach outside its build (DockerfileError names the line and why); returns the
    images it reads (every FROM and --from that is no stage of its own), in order: the build needs each of them on
    the host, since it never pulls one."""
    instructions = parse(text)
    images: list[str] = []
    froms = [i for i in instructions if i.keyword == "FROM"]
    if not froms:
        raise DockerfileError("the Dockerfile has no FROM line")
    stages: list[_Stage] = []

    def source(ref: str, line: int, what: str) -> bool:
        """Whether `ref` is an earlier stage (True: of envfleet descent) or an allowed image; raises otherwise."""
        if "$" in ref:
            raise DockerfileError(f"{what} {echo(ref)} (line {line}) uses a variable; name the image or stage")
        if not _PLAIN_REF.match(ref):
            # the builder unquotes and unescapes the word: envfleet/en"v-x" is envfleet/env-x
            raise DockerfileError(
                f"{what} {echo(ref)} (line {line}) is not a plain image or stage name; write it without quotes, "
                "escapes or other characters"
            )
        key = ref.lower()
        for s in stages:
            if key in s.names:
                return s.envfleet
        if _image_allowed(ref):
            if ref not in images:
                images.append(ref)
            return True
        why = "another environment's image" if ref.startswith(TENANT_IMAGE_PREFIX) else "not an envfleet image"
        raise DockerfileError(
            f"{what} {echo(ref)} (line {line}): {why}; use envfleet/base (or another envfleet image) or an earlier "
            "stage of this file"
        )

    for ins in instructions:
        kw, line = ins.keyword, ins.line
        if kw == "FROM":
            flags, rest = _flags(ins.args, line)
            if flags:
                raise DockerfileError(
                    f"line {line}: FROM --{next(iter(flags))} is not allowed (an image for another platform would be "
                    "pulled, and builds are offline); name the image alone"
                )
            words = _SEPARATOR.split(rest) if rest else []
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
        elif kw == "VOLUME":
            raise DockerfileError(
                f"line {line}: VOLUME is not allowed (every sandbox would get a writable engine volume outside its "
                "read-only root and disk caps); write under /workspace or /tmp instead"
            )
        elif kw in ("ENTRYPOINT", "HEALTHCHECK") and len(stages) == len(froms):
            raise DockerfileError(
                f"line {line}: {kw} never runs in a sandbox (envd is its first process and its health check); "
                "start what the task needs in its setup instead"
            )
        elif kw in ("COPY", "ADD", "RUN") and any(_HEREDOC.match(w) for w in _SEPARATOR.split(ins.args)):
            raise DockerfileError(
                f"line {line}: {kw} with '<<': newer builders read a heredoc there and take the lines after it as "
                "data; put the content in a file of the image spec, or write it with printf"
            )
        elif kw in ("COPY", "ADD"):
            flags, rest = _flags(ins.args, line)
            for ref in flags.get("from", []):
                source(ref, line, f"{kw} --from")
            words = _words(rest)
            for src in words[:-1]:
                if kw == "ADD" and _EXPANDED.intersection(src):
                    raise DockerfileError(
                        f"line {line}: ADD source {echo(src)} has quotes, escapes or variables, which the builder "
                        "expands (into a URL, maybe); write the path plainly"
                    )
                if kw == "ADD" and _URL.match(src):
                    raise DockerfileError(
                        f"line {line}: ADD {echo(src)}: the daemon would fetch it on the host network; "
                        "builds are offline, put the file in the image spec instead"
                    )
                if not flags.get("from") and ".." in PurePosixPath(src).parts:
                    raise DockerfileError(f"line {line}: {kw} source {echo(src)} leaves the build context")
        elif kw == "RUN":
            flags, _ = _flags(ins.args, line)
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
    return images
