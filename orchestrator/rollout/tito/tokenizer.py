"""The model's tokenizer, by name: resolved in the server's configured tokenizer directories, loaded once per
process, off the event loop.

The name comes from a tenant (PolicyEndpoint.tokenizer), so it never becomes an arbitrary host path or a hub
download: it must be a plain name (no path separator, no '..'), it names a folder directly inside one of the
directories the operator configured (`envfleet serve --tokenizer-dir DIR`), and it is loaded with
`local_files_only=True` and `trust_remote_code=False`, so nothing is fetched and no code shipped beside the files
runs. Symlinks inside an operator's directory are the operator's choice and are followed.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestrator.core.errors import ConfigError, InvalidRequestError
from orchestrator.core.policy import check_name
from orchestrator.rollout.tito.template import ChatTemplateTokens

log = logging.getLogger(__name__)

MAX_LISTED = 20  # names an error message lists


class TokenizerDirs:
    """The operator's tokenizer directories, and the one way a tenant's tokenizer name becomes a folder in them."""

    def __init__(self, dirs: Sequence[Path | str] = ()) -> None:
        self.dirs = [Path(d) for d in dirs]

    def names(self) -> list[str]:
        """The tokenizer names these directories offer (their folders), sorted."""
        found: set[str] = set()
        for d in self.dirs:
            try:
                found |= {p.name for p in d.iterdir() if p.is_dir() and _valid(p.name)}
            except OSError:
                continue
        return sorted(found)

    def resolve(self, name: str) -> Path:
        """The folder of tokenizer `name`: the first configured directory holding it. InvalidRequestError when the
        name is not a plain name or no directory has it (the message lists what the server offers)."""
        try:
            check_name(name, "tokenizer")
        except ValueError as e:
            raise InvalidRequestError(f"policy.tokenizer {name[:140]!r}: {e}") from None
        if not self.dirs:
            raise InvalidRequestError(
                f"policy.tokenizer {name!r}: this server has no tokenizer directories (the operator sets them with "
                "`envfleet serve --tokenizer-dir DIR`); use token_mode chat"
            )
        for d in self.dirs:
            candidate = d / name
            if candidate.is_dir():
                return candidate
        offered = self.names()
        shown = ", ".join(offered[:MAX_LISTED]) + (", ..." if len(offered) > MAX_LISTED else "")
        raise InvalidRequestError(
            f"policy.tokenizer {name!r} is not in this server's tokenizer directories; it offers: {shown or 'none'}"
        )


def _valid(name: str) -> bool:
    try:
        check_name(name, "tokenizer")
    except ValueError:
        return False
    return True


def load_tokenizer(path: Path) -> Any:
    """A Hugging Face tokenizer from a local folder: never the network (`local_files_only`), never code shipped
    beside it (`trust_remote_code=False`). Blocking (a second or so): call it from a thread."""
    from transformers import AutoTokenizer  # heavy; only tito needs it

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)


MAX_TEMPLATE_VARIANTS = 32  # chat template tokens kept, one per tokenizer and set of template variables (the newest)


class TokenizerCache:
    """Tokenizers by name, each loaded once per process in a thread (concurrent rollouts wait for the one load), and
    their chat template tokens by the template's variables (a job's policy.chat_template_kwargs)."""

    def __init__(self, dirs: TokenizerDirs | Sequence[Path | str] = ()) -> None:
        self.dirs = dirs if isinstance(dirs, TokenizerDirs) else TokenizerDirs(dirs)
        self._loaded: dict[str, Any] = {}  # name -> tokenizer
        self._loading: dict[str, asyncio.Task[Any]] = {}
        self._tokens: collections.OrderedDict[tuple[str, str], ChatTemplateTokens] = collections.OrderedDict()
        self.loads = 0  # tokenizers loaded so far (each name once)

    async def get(self, name: str, template_kwargs: str = "") -> ChatTemplateTokens:
        """The chat template tokens of tokenizer `name` under `template_kwargs` (a JSON object's text, "" for none).
        ConfigError when this process cannot load it (the control plane resolved the name at submit; a worker whose
        directories lack it is misconfigured), or when the template cannot be read for tito."""
        key = (name, template_kwargs)
        tokens = self._tokens.get(key)
        if tokens is not None:
            self._tokens.move_to_end(key)
            return tokens
        tokenizer = await self._tokenizer(name)
        tokens = self._tokens.get(key)  # made meanwhile, by a rollout that waited for the same load
        if tokens is None:
            try:
                tokens = ChatTemplateTokens(tokenizer, json.loads(template_kwargs) if template_kwargs else None)
            except Exception as e:  # a template tito cannot read, or one its variables break (jinja's errors)
                raise ConfigError(f"tokenizer {name!r}'s chat template: {type(e).__name__}: {e}") from e
            self._tokens[key] = tokens
            if len(self._tokens) > MAX_TEMPLATE_VARIANTS:
                self._tokens.popitem(last=False)
        return tokens

    async def _tokenizer(self, name: str) -> Any:
        tokenizer = self._loaded.get(name)
        if tokenizer is not None:
            return tokenizer
        task = self._loading.get(name)
        if task is None:
            task = self._loading[name] = asyncio.create_task(self._load(name), name=f"load tokenizer {name}")
        try:
            # shielded: one rollout cancelled while waiting does not cancel the load the others wait for
            return await asyncio.shield(task)
        finally:
            if task.done() and self._loading.get(name) is task:
                del self._loading[name]

    async def _load(self, name: str) -> Any:
        try:
            path = self.dirs.resolve(name)
        except InvalidRequestError as e:
            raise ConfigError(f"this process cannot load the tokenizer: {e}") from None
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, path)
            tokens = ChatTemplateTokens(
                tokenizer
            )  # a template tito cannot read is refused at once, whatever its variables
        except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a bad folder
            raise ConfigError(f"tokenizer {name!r} ({path}) could not be loaded: {type(e).__name__}: {e}") from e
        log.info("loaded tokenizer %s from %s", name, path)
        self.loads += 1
        self._loaded[name] = tokenizer
        self._tokens[(name, "")] = tokens  # the check's own, kept: get() finds it rather than make it again
        return tokenizer
