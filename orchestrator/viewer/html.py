"""HTML building blocks. Every piece of rollout or job data goes through `esc`: rollout text is hostile (a policy or
a tool may print `<script>`), and the pages also carry a Content-Security-Policy that forbids scripts altogether."""

from __future__ import annotations

import html
from collections.abc import Mapping
from urllib.parse import quote, urlencode

FOLD_CHARS = 2000  # longer texts are folded in <details>
SHOWN_CHARS = 64 << 10  # and cut past this many characters
FOLD_LINES = 30

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:8px 16px}header a{color:#fff;text-decoration:none;margin-right:16px}
main{padding:12px 16px;max-width:1400px}
table{border-collapse:collapse;background:#fff;width:100%}th,td{border-bottom:1px solid #e3e6eb;padding:3px 8px;
text-align:left;white-space:nowrap;overflow:hidden;text-overflow:ellipsis;max-width:360px}
th a{color:inherit}td.num,th.num{text-align:right}
.scroll{overflow-x:auto}
.bar{background:#e3e6eb;height:10px;width:160px;display:inline-block}
.bar i{display:block;height:10px;background:#3a7bd5}
.card{background:#fff;border:1px solid #e3e6eb;border-radius:4px;padding:8px 12px;margin:8px 0}
.turn{border-left:4px solid #aab}.role-assistant{border-color:#2e9d5b}.role-tool{border-color:#d58b3a}
.role-user{border-color:#3a7bd5}.role-system{border-color:#888}
pre{white-space:pre-wrap;word-break:break-word;margin:4px 0;font:12px/1.35 ui-monospace,monospace}
.badge{display:inline-block;padding:0 6px;border-radius:8px;background:#e3e6eb;font-size:12px}
.s-OK{background:#c9efd6}.s-TRUNCATED{background:#f3e7b4}.s-TIMEOUT,.s-POLICY_ERROR,.s-ENV_ERROR,.s-INFRA_ERROR
{background:#f5c7c7}
.tokens{font:12px/1.9 ui-monospace,monospace;word-break:break-all;background:#fff;padding:6px}
.tokens span{padding:1px 0;margin-right:1px}.m1{background:#b9ecc8}.m0{background:#d6dcf5;color:#555}
.mp{background:#eee;color:#777}.odd{outline:2px solid #d33}
.legend span{padding:0 6px;margin-right:8px}
.wf{position:relative;height:18px;background:#f0f1f4;margin:2px 0}.wf i{position:absolute;top:0;height:18px}
.wf-row{display:grid;grid-template-columns:140px 1fr 90px;gap:8px;align-items:center}
.p-queue{background:#999}.p-sandbox_acquire{background:#d58b3a}.p-setup{background:#c8a400}
.p-generation{background:#2e9d5b}.p-tools{background:#3a7bd5}.p-scoring{background:#8e44ad}
.groups{display:grid;grid-template-columns:repeat(auto-fill,minmax(300px,1fr));gap:8px}
form.filters input,form.filters select{margin-right:8px}
.pager a,.pager b{margin-right:8px}
svg{background:#fff;border:1px solid #e3e6eb}
"""

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; form-action 'self'; base-uri 'none'"


def esc(value: object) -> str:
    """Text made safe for HTML content and quoted attribute values."""
    return html.escape(str(value), quote=True)


def href(path: str, params: Mapping[str, str] | None = None) -> str:
    """An escaped link target: the path (its dynamic segments quoted by `seg`, so a '%' is one of seg's: quoting it
    again made ':' %253A, which the server unquotes once, and every rollout link was a 404), then the query."""
    url = quote(path, safe="/%")
    if params:
        url += "?" + urlencode(params)
    return esc(url)


def seg(value: str) -> str:
    """One URL path segment (an id that may hold '/' or ':'), for `href`."""
    return quote(value, safe="")


def folded(text: str, summary: str = "") -> str:
    """A <pre> of the text, folded in <details> when it is long, and cut at SHOWN_CHARS: a tool output of 16 MiB of
    quotes was a page of 96 MiB, and about 500 MiB of the control plane's memory for one request."""
    if len(text) <= FOLD_CHARS and text.count("\n") < FOLD_LINES:
        return f"<pre>{esc(text)}</pre>"
    head = summary or f"{len(text):,} characters, {text.count(chr(10)) + 1:,} lines"
    shown = esc(text[:SHOWN_CHARS])
    if len(text) > SHOWN_CHARS:
        shown += f"\n[... {len(text) - SHOWN_CHARS:,} more characters not shown]"
    return f"<details><summary>{esc(head)}</summary><pre>{shown}</pre></details>"


def badge(status: str) -> str:
    """A rollout status as a coloured badge."""
    return f'<span class="badge s-{esc(status)}">{esc(status)}</span>'


def fmt_reward(value: float | None) -> str:
    """A reward or advantage, or a dash when there is none."""
    return "&ndash;" if value is None else f"{value:.3f}"


def page(title: str, body: str, crumbs: list[tuple[str, str]] | None = None) -> str:
    """A whole page: the style, a header with breadcrumbs, the body."""
    nav = "".join(f'<a href="{link}">{esc(name)}</a>' for name, link in [("envfleet jobs", "/"), *(crumbs or [])])
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
        f'<meta name="viewport" content="width=device-width"><style>{STYLE}</style></head>'
        f"<body><header>{nav}</header><main><h2>{esc(title)}</h2>{body}</main></body></html>"
    )
