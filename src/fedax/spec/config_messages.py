"""One-line messages for a config that does not validate (``fedax.spec.config``):
the key at fault, dotted, and what it accepts in words (derived from the schema's
annotations and constraints), or the key an unknown one most likely misspells."""

from __future__ import annotations

import difflib
import types
from collections.abc import Sequence
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from fedax.spec.sections import _KeyedError


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """``Annotated[X, ...] | None`` -> ``(X, True)``; ``X`` -> ``(X, False)``."""
    optional = False
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            annotation, optional = args[0], len(args) < len(get_args(annotation))
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation, optional


def _section(annotation: Any) -> type[BaseModel] | None:
    annotation, _ = _unwrap_optional(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _bounds(field: FieldInfo) -> str:
    """The numeric constraints of a field as text: " in (0, 1]", " > 0" and so on."""
    lo = hi = None
    for m in field.metadata:  # annotated_types.Gt/Ge/Lt/Le, one bound each
        for attr, bracket in (("gt", "("), ("ge", "["), ("lt", ")"), ("le", "]")):
            bound = getattr(m, attr, None)
            if bound is not None and attr in ("gt", "ge"):
                lo = (bracket, bound)
            elif bound is not None:
                hi = (bracket, bound)
    if lo and hi:
        return f" in {lo[0]}{lo[1]}, {hi[1]}{hi[0]}"
    if lo:
        return f" {'>' if lo[0] == '(' else '>='} {lo[1]}"
    if hi:
        return f" {'<' if hi[0] == ')' else '<='} {hi[1]}"
    return ""


def _allowed(field: FieldInfo) -> str:
    """What a field accepts, in words, derived from its annotation and constraints."""
    annotation, optional = _unwrap_optional(field.annotation)
    section = _section(annotation)
    if field.description:
        text = field.description
    elif get_origin(annotation) is Literal:
        text = "one of " + ", ".join(repr(a) for a in get_args(annotation))
    elif section is not None:
        text = "a section with keys " + ", ".join(section.model_fields)
    elif annotation is bool:
        text = "true or false"
    elif annotation is int:
        text = "an integer" + _bounds(field)
    elif annotation is float:
        text = "a number" + _bounds(field)
    else:
        text = str(annotation)
    return text + (" or null" if optional else "")


def _model_at(path: Sequence[str | int], root: type[BaseModel]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = root
    for part in path:
        if model is None or part not in model.model_fields:
            return None
        model = _section(model.model_fields[part].annotation)
    return model


def _field_at(path: Sequence[str | int], root: type[BaseModel]) -> FieldInfo | None:
    parent = _model_at(path[:-1], root) if path else None
    name = path[-1] if path else None
    return parent.model_fields.get(name) if parent is not None and isinstance(name, str) else None


def _closest(name: str, keys: Sequence[str]) -> str | None:
    """The key ``name`` most likely misspells (difflib's ratio >= 0.6, spelled as is or
    with its ``_`` words sorted: ``lr_client`` is ``client_lr``), or None."""
    def words(key: str) -> str:
        return "_".join(sorted(key.split("_")))

    def score(key: str) -> float:
        return max(difflib.SequenceMatcher(None, name, key).ratio(),
                   difflib.SequenceMatcher(None, words(name), words(key)).ratio())

    best = max(keys, key=score, default=None)
    return best if best is not None and score(best) >= 0.6 else None


def _unknown_key(path: Sequence[str], model: type[BaseModel]) -> str:
    """``unknown config key 'a.b' (did you mean 'a.c'?)``, or with the keys allowed there
    when none is close."""
    near = _closest(str(path[-1]), list(model.model_fields))
    if near:
        return (f"unknown config key '{'.'.join(path)}' (did you mean "
                f"'{'.'.join([*path[:-1], near])}'?)")
    return f"unknown config key '{'.'.join(path)}' (allowed: {', '.join(model.model_fields)})"


def _one_line(error: ValidationError, root: type[BaseModel]) -> str:
    """The first error of a pydantic ValidationError as one line naming the key; an
    unknown key first (a misspelled key also makes the key it misspells missing)."""
    errors = error.errors()
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = [str(part) for part in err["loc"]]
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        return _unknown_key(loc, _model_at(loc[:-1], root) or root)
    if err["type"] == "value_error" and isinstance(err["ctx"]["error"], _KeyedError):
        return f"config key '{err['ctx']['error'].key}': {err['ctx']['error']}"
    if not loc:
        return f"config must be a mapping of keys to values, got {err['input']!r}"
    field = _field_at(loc, root)
    allowed = _allowed(field) if field is not None else err["msg"]
    if err["type"] == "missing":
        return f"config key '{key}' is required: {allowed}"
    if err["type"] == "value_error":  # our validators' messages say what they got
        error = err["ctx"]["error"]
        return f"config key '{getattr(error, 'key', key)}': {error}"
    return f"config key '{key}': must be {allowed}, got {err['input']!r}"
