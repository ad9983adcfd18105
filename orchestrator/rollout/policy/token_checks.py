"""The token ids and logprobs a policy server returns, checked where they are parsed: each one exact and within what
the trainer's contract can carry (protos/orchestrator.proto, `Tokens`), or a PolicyTokenError naming the first bad
value and where it was. The rollout is then POLICY_ERROR, like any other answer that is not a completion.

Why here and not at encoding: an id of 2^31 or a NaN logprob kept in a rollout makes its protobuf encoding raise
after the rollout ran, on a worker (no result is ever sent) or on the control plane's stream (every read of the job
breaks there). An id is never clamped or wrapped to fit: a trainer must get the ids the server sampled, or none.

No check against the tokenizer's vocabulary: a model's embedding table is often larger than its tokenizer (padded
to a multiple of 64 or 128), so a server may sample an id the tokenizer does not name, and that id is still the
one the trainer's model scores.

The server is the tenant's choice: a bad number is shown (cut short), anything else only by its type, never quoted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from orchestrator.core.echo import echo
from orchestrator.core.errors import PolicyTokenError
from orchestrator.core.models import LOGPROB_MIN, TOKEN_ID_MAX

__all__ = ["LOGPROB_MIN", "TOKEN_ID_MAX"]  # the wire's bounds, checked here on the policy's answers
# With return_tokens_as_token_ids, vLLM writes each sampled token as "token_id:N".
TOKEN_ID_PREFIX = "token_id:"

_INT = frozenset({int})  # decoded JSON has no other int subclass: bool is told apart by type, in C
_NUMBER = frozenset({int, float})
_DECIMAL = re.compile(r"-?[0-9]{1,20}")  # int() alone would take "+5", " 5", "5_0" and non-ASCII digits


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return f"{str(value).lower()} (a bool)"
    if type(value) is int:
        return echo(value, 40) if value.bit_length() <= 256 else f"an int of {value.bit_length()} bits"
    if type(value) is float:
        return f"{echo(value, 40)} (a float)"
    return "null" if value is None else f"a {type(value).__name__}"


def check_id(value: Any, where: str) -> int:
    """`value` as a token id: an int (not a bool) in 0..TOKEN_ID_MAX, or PolicyTokenError naming `where`."""
    if type(value) is not int or not 0 <= value <= TOKEN_ID_MAX:
        raise PolicyTokenError(
            f"the policy server's {where} is {_shown(value)}: a token id is an int in 0..{TOKEN_ID_MAX} (the "
            "wire's int32)"
        )
    return value


def token_ids(value: Any, where: str, offset: int = 0) -> list[int] | None:
    """A list of token ids as the server sent it at `where` (a field's path); None when the field is absent (null),
    PolicyTokenError when it is not a list of ids. `offset` is added to the index a message names (a list that is
    the tail of a longer one)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise PolicyTokenError(f"the policy server's {where} is {_shown(value)}, expected a list of token ids")
    # the common case in C: every item an int, the least and the greatest in range
    if not value or (set(map(type, value)) <= _INT and min(value) >= 0 and max(value) <= TOKEN_ID_MAX):
        return list(value)
    for i, v in enumerate(value):
        check_id(v, f"{where}[{offset + i}]")
    raise AssertionError("unreachable: some item failed the check above")


def ids_from_labels(labels: Sequence[Any], where: str) -> list[int] | None:
    """The ids of vLLM's "token_id:N" token labels; None when they are not all such labels (text tokens: the server
    was not asked, or ignored it). `where` names item i as `{i}`, e.g. `choices[0].logprobs.tokens[{i}]`."""
    if not all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in labels):
        return None
    out: list[int] = []
    for i, label in enumerate(labels):
        digits = label[len(TOKEN_ID_PREFIX) :]
        if not _DECIMAL.fullmatch(digits):
            raise PolicyTokenError(
                f"the policy server's {where.format(i=i)} is {TOKEN_ID_PREFIX!r} and {len(digits)} characters that "
                "are not a decimal token id (not shown)"
            )
        out.append(check_id(int(digits), where.format(i=i)))
    return out


def check_logprob(value: Any, where: str) -> float:
    """`value` as a logprob: a number (not a bool), finite, <= 0 and within float32; else PolicyTokenError."""
    if type(value) not in _NUMBER:
        raise PolicyTokenError(f"the policy server's {where} is {_shown(value)}, expected a number (a logprob)")
    if not LOGPROB_MIN <= value <= 0.0:  # NaN fails both comparisons; a huge int is compared exactly
        raise PolicyTokenError(
            f"the policy server's {where} is {_shown(value)}: a logprob is a finite number <= 0, at least "
            f"{LOGPROB_MIN:g} (the wire's float32)"
        )
    return float(value)


def logprobs(values: Sequence[Any], where: str, offset: int = 0) -> list[float]:
    """Checked logprobs as floats; `where` names item i as `{i}` (counted from `offset`)."""
    if not values:
        return []
    if set(map(type, values)) <= _NUMBER and min(values) >= LOGPROB_MIN and max(values) <= 0.0:
        out = [float(v) for v in values]  # every int among them is within float range: converted exactly
        # a NaN can slip past min and max (every comparison with it is false); the sum keeps it, and an inf
        if math.isfinite(sum(out)):
            return out
    for i, v in enumerate(values):
        check_logprob(v, where.format(i=offset + i))
    raise AssertionError("unreachable: some item failed the check above")


def same_length(ids: Sequence[int], lps: Sequence[float], ids_where: str, lps_where: str) -> None:
    """One logprob per sampled id, or PolicyTokenError: they are never aligned by guesswork."""
    if len(ids) != len(lps):
        raise PolicyTokenError(
            f"the policy server returned {len(ids)} token ids ({ids_where}) but {len(lps)} logprobs ({lps_where}): "
            "each sampled token needs its logprob"
        )
