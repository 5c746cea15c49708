"""The paper's statements as data, checked against a reproduction's results.

A claim in a paper file::

    - claim: "{rule} tolerates a minority of arbitrary clients ({attack}, f = {top})"
      source: yin                       # a key of the file's ``sources``, or the text
      for: {rule: [median, trimmed_mean], attack: "settings.attacks"}
      let: {top: "fmt(max(settings.fractions), 'g')",
            drop: "table[rule].clean - table[rule][attack + '@' + top]"}
      when: "rule in table"             # the claim is tested only where this holds
      held: "drop < 0.05"
      evidence: "{rule}: clean {table[rule].clean:.4f} (drop {drop:.4f}; held if < 0.05)"

``for`` expands one claim per combination of its values (a list, or an expression giving
one), ``let`` binds names in order, ``claim`` and ``evidence`` are templates and ``held`` an
expression (:mod:`fedax.reproduce.expr`) over the results. A ``held`` that is None (a value
is missing) reads "not tested". Each checked claim is ``{claim, source, held, evidence}``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from fedax.reproduce.expr import ExprError, evaluate, render

_CLAIM_KEYS = {"claim", "source", "for", "let", "when", "held", "evidence"}


def expand(spec: Mapping[str, Any] | None, names: Mapping[str, Any]) -> Iterator[dict]:
    """Every binding of a ``for`` mapping: name → a list (or an expression giving one); the
    product in the order written, later names able to use earlier ones."""
    items = list((spec or {}).items())

    def rec(i: int, bound: dict[str, Any]) -> Iterator[dict]:
        if i == len(items):
            yield dict(bound)
            return
        key, values = items[i]
        if isinstance(values, str):
            values = evaluate(values, {**names, **bound})
        if isinstance(values, Mapping):
            values = list(values)
        for value in values:
            yield from rec(i + 1, {**bound, key: value})

    yield from rec(0, {})


def bind(lets: Mapping[str, str] | None, names: Mapping[str, Any]) -> dict[str, Any]:
    """``names`` with each ``let`` expression's value bound, in order."""
    scope = dict(names)
    for key, text in (lets or {}).items():
        scope[key] = evaluate(text, scope) if isinstance(text, str) else text
    return scope


def check_claims(claims: Sequence[Mapping[str, Any]], results: Mapping[str, Any],
                 sources: Mapping[str, str]) -> list[dict[str, Any]]:
    """Each claim of the paper file, expanded and checked against ``results``."""
    checked = []
    for spec in claims:
        unknown = sorted(set(spec) - _CLAIM_KEYS)
        if unknown or "claim" not in spec or "held" not in spec:
            raise ExprError(f"claim {spec.get('claim', '?')!r}: "
                            + (f"unknown keys {unknown}" if unknown else
                               "needs 'claim' and 'held'"))
        for binding in expand(spec.get("for"), results):
            scope = bind(spec.get("let"), {**results, **binding})
            if "when" in spec and not evaluate(spec["when"], scope):
                continue
            held = evaluate(spec["held"], scope)
            source = spec.get("source", "")
            checked.append({
                "claim": render(spec["claim"], scope),
                "source": sources.get(source, source),
                "held": None if held is None else bool(held),
                "evidence": render(spec.get("evidence", ""), scope),
            })
    return checked


def claim_lines(checked: Sequence[Mapping[str, Any]]) -> list[str]:
    """The report's lines: ``- **held**: claim (source). evidence.``"""
    lines = []
    for c in checked:
        verdict = {True: "held", False: "did not hold", None: "not tested"}[c["held"]]
        source = c["source"].split(",")[0]
        source = f" ({source} et al.)" if source and "et al" not in source else (
            f" ({source})" if source else "")
        evidence = f" {c['evidence']}." if c.get("evidence") else ""
        lines.append(f"- **{verdict}**: {c['claim']}{source}.{evidence}")
    return lines
