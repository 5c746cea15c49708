"""The small expression language of a paper's YAML: claims, derived values and report text.

An expression is a Python expression over the results (``drop < 0.05``, ``max(drops)``,
``table['median']['clean']``, ``settings.fractions``: a mapping's keys read as attributes)
restricted to literals, names, arithmetic, comparisons, boolean logic, conditionals,
subscripts, comprehensions and calls of the functions in :data:`FUNCTIONS` and of a few
methods of strings and mappings. Anything else (attributes with underscores, imports,
lambdas, assignment) is refused before it runs, so a paper file cannot run code.

A template is text with ``{expression}`` or ``{expression:spec}`` fields (``str.format``'s
syntax; ``{{`` is a brace); a field whose value is None or not finite prints ``—`` when it
has a numeric spec.
"""

from __future__ import annotations

import ast
import math
import re
import statistics
from collections.abc import Mapping
from typing import Any


class ExprError(ValueError):
    """An expression of a paper file that does not parse, is not allowed, or fails."""


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def fmt(value: Any, spec: str = "") -> str:
    """``format(value, spec)``; ``—`` for None or a non-finite number under a numeric spec."""
    if spec and spec[-1:] in "eEfFgG%d" and not _finite(value):
        return "—"
    if value is None:
        return "—"
    return format(value, spec)


def mean(values: Any) -> float:
    """The mean of the finite values (NaN when there are none)."""
    kept = [float(v) for v in values if _finite(v)]
    return statistics.fmean(kept) if kept else math.nan


def find(rows: Any, **where: Any) -> Any:
    """The first row (a mapping) whose values match ``where``; None when none does."""
    return next((r for r in rows if all(r.get(k) == v for k, v in where.items())), None)


def unique(values: Any) -> list[Any]:
    """The distinct values in their first order."""
    return list(dict.fromkeys(values))


def slug(text: Any) -> str:
    """``text`` as a file name: lower case, each run of characters other than letters and
    digits one ``-`` (``"top-k 1% + EF"`` → ``"top-k-1-ef"``)."""
    return re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-")


FUNCTIONS: dict[str, Any] = {
    "abs": abs, "all": all, "any": any, "bool": bool, "dict": dict, "enumerate": enumerate,
    "find": find, "float": float, "fmt": fmt, "int": int, "isfinite": _finite, "len": len,
    "list": list, "max": max, "mean": mean, "min": min, "nan": math.nan, "inf": math.inf,
    "range": range, "round": round, "slug": slug, "sorted": sorted, "str": str, "sum": sum,
    "tuple": tuple, "unique": unique, "zip": zip,
}
_METHODS = frozenset({"get", "items", "keys", "values", "startswith", "endswith", "split",
                      "replace", "join", "lower", "upper", "strip", "format", "count", "index"})
_NODES = (ast.Expression, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Compare, ast.IfExp,
          ast.Call, ast.Name, ast.Constant, ast.Subscript, ast.Slice, ast.List, ast.Tuple,
          ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp, ast.GeneratorExp,
          ast.comprehension, ast.Attribute, ast.Load, ast.Store, ast.keyword, ast.Starred,
          ast.JoinedStr, ast.FormattedValue, ast.operator, ast.unaryop, ast.cmpop,
          ast.boolop)


class _View(dict):
    """A dict whose keys also read as attributes (``settings.fractions``); what it hands out
    is wrapped in turn, on access."""

    def __getitem__(self, key):
        return _wrap(super().__getitem__(key))

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no key {name!r}") from None

    def get(self, key, default=None):
        return _wrap(super().get(key, default))

    def items(self):
        return [(k, _wrap(v)) for k, v in super().items()]

    def values(self):
        return [_wrap(v) for v in super().values()]


def _wrap(value: Any) -> Any:
    if isinstance(value, Mapping) and not isinstance(value, _View):
        return _View(value)
    return [_wrap(v) for v in value] if isinstance(value, list) else value


def _unwrap(value: Any) -> Any:
    if isinstance(value, dict):  # views, and dicts built by the expression
        return {k: _unwrap(v) for k, v in dict.items(value)}
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v) for v in value)
    return value


def _check(tree: ast.AST, text: str) -> None:
    for node in ast.walk(tree):
        if not isinstance(node, _NODES):
            raise ExprError(f"{text!r}: {type(node).__name__} is not allowed in a paper's "
                            "expressions")
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            raise ExprError(f"{text!r}: attribute {node.attr!r} is not allowed")
        if isinstance(node, ast.Name) and node.id.startswith("__"):
            raise ExprError(f"{text!r}: name {node.id!r} is not allowed")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr not in _METHODS):
            raise ExprError(f"{text!r}: method {node.func.attr!r} is not allowed (allowed: "
                            f"{', '.join(sorted(_METHODS))})")


_COMPILED: dict[str, Any] = {}


def evaluate(text: str, names: Mapping[str, Any]) -> Any:
    """The value of the expression ``text`` over ``names`` (and :data:`FUNCTIONS`)."""
    code = _COMPILED.get(text)
    if code is None:
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except SyntaxError as err:
            raise ExprError(f"{text!r} is not an expression: {err.msg}") from None
        _check(tree, text)
        code = _COMPILED[text] = compile(tree, "<paper>", "eval")
    scope = {"__builtins__": {}, **FUNCTIONS, **{k: _wrap(v) for k, v in names.items()}}
    try:
        return _unwrap(eval(code, scope))  # noqa: S307 (checked above: no calls but FUNCTIONS)
    except ExprError:
        raise
    except Exception as err:  # the paper's expression failed on these results
        raise ExprError(f"{text!r}: {type(err).__name__}: {err}") from None


_SPEC = re.compile(r"(.?[<>=^])?[+\- ]?#?0?\d*[,_]?(\.\d+)?[a-zA-Z%]?")


def _fields(template: str):
    """``(literal, expression, spec)`` pieces of a template (``{{``/``}}`` are braces)."""
    i, literal = 0, []
    while i < len(template):
        ch = template[i]
        if ch in "{}" and template[i + 1:i + 2] == ch:
            literal.append(ch)
            i += 2
            continue
        if ch == "}":
            raise ExprError(f"{template!r}: a single '}}' (write '}}}}' for a brace)")
        if ch != "{":
            literal.append(ch)
            i += 1
            continue
        depth, j = 1, i + 1
        while j < len(template) and depth:
            depth += {"{": 1, "}": -1}.get(template[j], 0)
            j += 1
        if depth:
            raise ExprError(f"{template!r}: an unclosed '{{'")
        field, spec = template[i + 1:j - 1], ""
        head, sep, tail = field.rpartition(":")
        if sep and _SPEC.fullmatch(tail) and head.count("[") == head.count("]"):
            field, spec = head, tail
        yield "".join(literal), field, spec
        literal, i = [], j
    yield "".join(literal), None, ""


def render(template: str, names: Mapping[str, Any]) -> str:
    """``template`` with each ``{expression[:spec]}`` field replaced by its value."""
    out = []
    for literal, field, spec in _fields(template):
        out.append(literal)
        if field is not None:
            value = evaluate(field, names)
            out.append(fmt(value, spec) if spec or value is None else str(value))
    return "".join(out)
