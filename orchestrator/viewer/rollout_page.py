"""One rollout: its turns (tool calls and outputs, long ones folded), reward components, a timing waterfall, and its
tokens coloured by loss mask with logprobs on hover."""

from __future__ import annotations

from collections.abc import Callable

from orchestrator.core.models import Rollout, Tokens, Turn
from orchestrator.viewer.html import badge, esc, fmt_reward, folded, href, page, seg
from orchestrator.viewer.pages import job_url

# A token id -> its text, when the policy's tokenizer is known (the toy one of the scripted policy); None: show ids.
TokenDecoder = Callable[[int], str]

PHASES = ("queue", "sandbox_acquire", "setup", "generation", "tools", "scoring")
MAX_TOKENS_SHOWN = 20_000  # a page stays light; the counts above the tokens cover all of them


def _turn(i: int, t: Turn) -> str:
    parts = [f'<div class="card turn role-{esc(t.role)}" id="turn-{i}"><b>{i}. {esc(t.role)}</b>']
    if t.name:
        parts.append(f" · tool <code>{esc(t.name)}</code>")
    if t.tool_call_id:
        parts.append(f" · call <code>{esc(t.tool_call_id)}</code>")
    if t.text:
        parts.append(folded(t.text))
    for call in t.tool_calls:
        parts.append(
            f'<div class="call">→ <code>{esc(call.name)}</code> <small>{esc(call.id)}</small>'
            f"{folded(call.arguments, f'arguments: {len(call.arguments):,} characters')}</div>"
        )
    parts.append("</div>")
    return "".join(parts)


def _waterfall(r: Rollout) -> str:
    timing = r.timing
    spans = [(p, float(getattr(timing, p))) for p in PHASES]
    whole = max(sum(s for _, s in spans), timing.total, 1e-9)
    rows, left = [], 0.0
    for phase, seconds in spans:
        rows.append(
            f'<div class="wf-row"><span>{phase}</span><div class="wf"><i class="p-{phase}" '
            f'style="left:{100 * left / whole:.2f}%;width:{max(100 * seconds / whole, 0.2 if seconds else 0):.2f}%">'
            f'</i></div><span class="num">{seconds:.3f} s</span></div>'
        )
        left += seconds
    note = (
        "<small>phases laid end to end; generation and tools alternate turn by turn in reality, shown here as "
        f"their sums. total {timing.total:.3f} s</small>"
    )
    return f'<div id="waterfall">{"".join(rows)}{note}</div>'


def _token(tid: int, decode: TokenDecoder | None) -> str:
    if decode is None:
        return str(tid) + " "
    try:
        return decode(tid)
    except ValueError:  # not in that tokenizer's vocabulary: the id is the honest answer
        return f"[{tid}]"


def _tokens(tokens: Tokens, decode: TokenDecoder | None) -> str:
    ids, mask, logprobs = tokens.completion_ids, tokens.completion_mask, tokens.completion_logprobs
    policy = sum(1 for m in mask if m)
    head = (
        f"<p>status <b>{esc(tokens.status)}</b> · prompt {len(tokens.prompt_ids):,} tokens · completion "
        f"{len(ids):,} tokens: {policy:,} policy, {len(mask) - policy:,} observation · "
        f"shown as {'text (toy tokenizer)' if decode else 'token ids'}</p>"
        '<p class="legend"><span class="mp">prompt</span><span class="m1">policy (mask 1)</span>'
        '<span class="m0">observation (mask 0)</span><span class="odd">suspect: observation with a logprob, or '
        "policy without one</span></p>"
    )
    if not ids and not tokens.prompt_ids:
        return head + "<p>No token ids: the policy server returned none (never invented).</p>"
    prompt = "".join(
        f'<span class="mp" title="prompt · id {t}">{esc(_token(t, decode))}</span>'
        for t in tokens.prompt_ids[:MAX_TOKENS_SHOWN]
    )
    spans = []
    for i, tid in enumerate(ids[:MAX_TOKENS_SHOWN]):
        m = mask[i] if i < len(mask) else 0
        lp = logprobs[i] if i < len(logprobs) else None
        suspect = (m == 0 and lp not in (None, 0.0)) or (m == 1 and lp is None)
        kind = "policy" if m else "observation"
        title = f"#{i} · id {tid} · {kind} · logprob {'none' if lp is None else f'{lp:.4f}'}"
        cls = f"m{1 if m else 0}{' odd' if suspect else ''}"
        spans.append(f'<span class="{cls}" title="{esc(title)}">{esc(_token(tid, decode))}</span>')
    cut = len(ids) > MAX_TOKENS_SHOWN or len(tokens.prompt_ids) > MAX_TOKENS_SHOWN
    more = f"<p>first {MAX_TOKENS_SHOWN:,} tokens shown</p>" if cut else ""
    return (
        f"{head}<details><summary>prompt tokens</summary><div class='tokens' id='prompt-tokens'>{prompt}</div>"
        f"</details><div class='tokens' id='tokens'>{''.join(spans)}</div>{more}"
    )


def _kv_table(table_id: str, values: dict[str, float]) -> str:
    if not values:
        return "<p>none</p>"
    rows = "".join(f'<tr><td>{esc(k)}</td><td class="num">{v:.4f}</td></tr>' for k, v in sorted(values.items()))
    return f'<table id="{table_id}" style="width:auto">{rows}</table>'


_SLIM = (
    '<h3>Turns</h3><div class="card" id="slim">Not kept: this server keeps an acked rollout\'s record without its '
    "turns and tokens (<code>--result-log-acked slim</code>); the trainer that acked it received them whole.</div>"
)


def rollout_page(r: Rollout, decode: TokenDecoder | None = None, *, slim: bool = False) -> str:
    """The whole rollout page. `slim`: the log dropped its turns and tokens at its ack, which the page says."""
    p = r.provenance
    error = f'<div class="card" id="error"><b>{esc(r.error.kind)}</b>{folded(r.error.message)}</div>' if r.error else ""
    summary = (
        f'<div class="card" id="summary">{badge(r.status.value)} reward <b>{fmt_reward(r.reward)}</b> · env '
        f"{esc(r.env)} · task {esc(r.task_id)} · sample {r.sample_index} · group "
        f'<a href="{href(f"{job_url(r.job_id)}/group/{seg(r.group_id)}")}">{esc(r.group_id)}</a> · '
        f"{'turns not kept' if slim else f'{len(r.turns)} turns'} · attempts {r.attempts} · "
        f"policy {esc(p.policy_model)} {esc(p.policy_version)} · "
        f"image {esc(p.image)} · seed {p.seed}</div>"
    )
    body = (
        f"{summary}{error}"
        f'<div style="display:flex;gap:24px;flex-wrap:wrap"><div><h3>Reward components</h3>'
        f"{_kv_table('components', r.reward_components)}</div><div><h3>Metrics</h3>"
        f"{_kv_table('metrics', r.metrics)}</div>"
        f'<div style="flex:1;min-width:420px"><h3>Timing</h3>{_waterfall(r)}</div></div>'
        + (
            _SLIM
            if slim
            else f'<h3>Turns</h3><div id="turns">{"".join(_turn(i, t) for i, t in enumerate(r.turns))}</div>'
            f"<h3>Tokens</h3>{_tokens(r.tokens, decode)}"
        )
    )
    return page(f"Rollout {r.id}", body, [(r.job_id, href(job_url(r.job_id)))])
