"""Bug injection with `ast`: small, realistic edits to one function at a time (SWE-smith's procedural bugs).

Operators: flip a comparison (`<` -> `>=`), shift a boundary (`<` -> `<=`), off-by-one on a small integer, drop a
branch (an `else`/`elif`, or an early-exit guard), swap two positional arguments, swap `and`/`or`, negate a
condition. Each edit replaces only the source span of the node it changes (byte offsets from the AST), so the rest
of the file keeps its formatting and the diff is as small as the bug; every mutant must still parse.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

OPERATORS = (
    "flip_comparison",
    "shift_boundary",
    "off_by_one",
    "drop_branch",
    "swap_arguments",
    "swap_boolean",
    "negate_condition",
)
_FLIP: dict[type[ast.cmpop], str] = {
    ast.Lt: ">=",
    ast.GtE: "<",
    ast.Gt: "<=",
    ast.LtE: ">",
    ast.Eq: "!=",
    ast.NotEq: "==",
    ast.Is: "is not",
    ast.IsNot: "is",
    ast.In: "not in",
    ast.NotIn: "in",
}
_SHIFT: dict[type[ast.cmpop], str] = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">"}
_OP_TOKEN = re.compile(r"<=|>=|==|!=|<|>|\bis\s+not\b|\bnot\s+in\b|\bis\b|\bin\b")
_EXITS = (ast.Return, ast.Raise, ast.Continue, ast.Break)


@dataclass(frozen=True)
class Mutant:
    """One bug: the file before and after, where it is and what kind it is (never shown to a policy)."""

    path: str
    function: str
    operator: str
    line: int
    original: str
    mutated: str

    @property
    def key(self) -> str:
        """A readable, stable description: path:function:operator@line."""
        return f"{self.path}:{self.function}:{self.operator}@{self.line}"


class _Source:
    """Source text addressed the way the AST does (line numbers, UTF-8 byte columns)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.data = text.encode()
        self.starts = [0]
        for line in self.data.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, line: int, col: int) -> int:
        return self.starts[line - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        start = self.offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]
        end = self.offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
        return start, end

    def get(self, start: int, end: int) -> str:
        return self.data[start:end].decode()

    def replace(self, start: int, end: int, new: str) -> str:
        return (self.data[:start] + new.encode() + self.data[end:]).decode()

    def drop_lines(self, first: int, last: int, placeholder: str | None = None) -> str:
        """Remove lines first..last (1-based, inclusive); optionally leave `placeholder` at the first's indent."""
        lines = self.text.splitlines(keepends=True)
        indent = re.match(r"\s*", lines[first - 1]).group(0)  # type: ignore[union-attr]
        keep = [f"{indent}{placeholder}\n"] if placeholder else []
        return "".join(lines[: first - 1] + keep + lines[last:])


def _functions(tree: ast.AST) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from walk(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def _own_nodes(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[tuple[ast.AST, ast.AST]]:
    """(node, parent) pairs of a function's body, not descending into nested functions, classes or lambdas."""
    stack: list[tuple[ast.AST, ast.AST]] = [(stmt, fn) for stmt in reversed(fn.body)]
    while stack:
        node, parent = stack.pop()
        yield node, parent
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        stack.extend((child, node) for child in reversed(list(ast.iter_child_nodes(node))))


def _is_docstring(node: ast.AST, parent: ast.AST) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _edits(src: _Source, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[tuple[str, int, str]]:
    """(operator, line, mutated text) candidates inside one function."""
    for node, parent in _own_nodes(fn):
        if _is_docstring(node, parent):
            continue
        line = getattr(node, "lineno", fn.lineno)
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            gap_start = src.span(node.left)[1]
            gap_end = src.span(node.comparators[0])[0]
            gap = src.get(gap_start, gap_end)
            m = _OP_TOKEN.search(gap)
            if m:
                op = type(node.ops[0])
                for name, table in (("flip_comparison", _FLIP), ("shift_boundary", _SHIFT)):
                    if op in table:
                        new_gap = gap[: m.start()] + table[op] + gap[m.end() :]
                        yield name, line, src.replace(gap_start, gap_end, new_gap)
        elif isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= 16:
            in_arith = isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Add | ast.Sub | ast.Mult)
            in_index = isinstance(parent, ast.Slice | ast.Subscript)
            in_range = isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id == "range"
            if in_arith or in_index or in_range:
                start, end = src.span(node)
                if src.get(start, end) == str(node.value):
                    yield "off_by_one", line, src.replace(start, end, str(node.value + 1))
        elif isinstance(node, ast.If):
            yield from _drop_branch(src, node, parent)
            if not isinstance(node.test, ast.Constant):
                start, end = src.span(node.test)
                yield "negate_condition", node.test.lineno, src.replace(start, end, f"not ({src.get(start, end)})")
        elif isinstance(node, ast.While) and not isinstance(node.test, ast.Constant):
            start, end = src.span(node.test)
            yield "negate_condition", node.test.lineno, src.replace(start, end, f"not ({src.get(start, end)})")
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            a, b = node.args[0], node.args[1]
            if not any(isinstance(x, ast.Starred) for x in (a, b)):
                (a0, a1), (b0, b1) = src.span(a), src.span(b)
                ta, tb = src.get(a0, a1), src.get(b0, b1)
                if ta != tb and "\n" not in ta + tb:
                    yield "swap_arguments", line, src.replace(a0, b1, tb + src.get(a1, b0) + ta)
        elif isinstance(node, ast.BoolOp):
            end_first = src.span(node.values[0])[1]
            start_second = src.span(node.values[1])[0]
            gap = src.get(end_first, start_second)
            word, other = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            new_gap = re.sub(rf"\b{word}\b", other, gap, count=1)
            if new_gap != gap:
                yield "swap_boolean", line, src.replace(end_first, start_second, new_gap)


def _drop_branch(src: _Source, node: ast.If, parent: ast.AST) -> Iterator[tuple[str, int, str]]:
    lines = src.text.splitlines()
    if node.orelse:
        first = node.orelse[0]
        last = node.orelse[-1].end_lineno or first.lineno
        if isinstance(first, ast.If) and len(node.orelse) == 1 and lines[first.lineno - 1].lstrip().startswith("elif"):
            # drop this elif's own block; a following elif/else stays attached to the chain
            body_end = first.body[-1].end_lineno or first.lineno
            yield "drop_branch", first.lineno, src.drop_lines(first.lineno, body_end)
            return
        body_end = node.body[-1].end_lineno or node.lineno
        for n in range(body_end + 1, first.lineno + 1):
            if re.match(r"\s*else\s*:", lines[n - 1]):
                yield "drop_branch", n, src.drop_lines(n, last)
                return
        return
    siblings = getattr(parent, "body", None)
    if isinstance(node.body[-1], _EXITS) and isinstance(siblings, list) and node in siblings and len(siblings) > 1:
        yield "drop_branch", node.lineno, src.drop_lines(node.lineno, node.end_lineno or node.lineno)


def mutants_of(path: str, text: str) -> list[Mutant]:
    """Every candidate mutant of one Python file (those that still parse and differ from the original)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    src = _Source(text)
    found: list[Mutant] = []
    seen: set[str] = set()
    for qualname, fn in _functions(tree):
        for operator, line, mutated in _edits(src, fn):
            if mutated == text or mutated in seen:
                continue
            try:
                ast.parse(mutated)
            except SyntaxError:
                continue
            seen.add(mutated)
            found.append(Mutant(path, qualname, operator, line, text, mutated))
    return found


def pick(candidates: Sequence[Mutant], count: int, rng: random.Random, *, per_function: int = 1) -> list[Mutant]:
    """A deterministic, diverse sample: at most `per_function` per function, operators spread evenly."""
    by_function: dict[tuple[str, str], list[Mutant]] = {}
    for m in candidates:
        by_function.setdefault((m.path, m.function), []).append(m)
    chosen: list[Mutant] = []
    keys = sorted(by_function)
    rng.shuffle(keys)
    for key in keys:
        options = by_function[key]
        rng.shuffle(options)
        # prefer operators used least so far
        used = {op: sum(c.operator == op for c in chosen) for op in OPERATORS}
        options.sort(key=lambda m: used[m.operator])
        chosen.extend(options[:per_function])
        if len(chosen) >= count:
            break
    return chosen[:count]
