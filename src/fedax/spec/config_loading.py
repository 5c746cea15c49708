"""Reading an experiment config: the YAML file (a key given twice is an error) and the
``--set key=value`` overrides, each failure a one-line :class:`ConfigError` naming the file
or the key. ``fedax.spec.config.load_config`` validates what these read."""

from __future__ import annotations

from os import PathLike
from typing import Any, get_origin

import yaml
from pydantic import BaseModel

from fedax.spec.config_messages import _allowed, _section, _unknown_key
from fedax.spec.errors import ConfigError


def apply_override(data: dict[str, Any], override: str, root: type[BaseModel]) -> None:
    """Applies one ``--set key=value`` to the parsed config ``data`` in place, the key
    checked against the schema ``root`` (the config); ``key=null`` unsets it."""
    key, sep, raw = override.partition("=")
    path = key.strip().split(".")
    if not sep or not all(path):
        raise ConfigError(f"malformed --set {override!r}: expected key=value, e.g. "
                          "server.lr=0.5 (key=null unsets a key)")
    model = root
    node = data
    for i, part in enumerate(path):
        if part not in model.model_fields:
            raise ConfigError(_unknown_key(path[: i + 1], model) + f" in --set {override!r}")
        if i == len(path) - 1:
            break
        if get_origin(model.model_fields[part].annotation) is dict and i == len(path) - 2:
            node = node.setdefault(part, {})  # a free mapping (algorithm_options): its keys
            break  # are checked by the config's validators
        section = _section(model.model_fields[part].annotation)
        if section is None:
            raise ConfigError(
                f"unknown config key '{key.strip()}' in --set {override!r}"
                f" ('{'.'.join(path[: i + 1])}' is not a section)"
            )
        field = model.model_fields[part]
        model = section
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(
                f"config key '{'.'.join(path[: i + 1])}': must be "
                f"{_allowed(field)}, got {child!r}"
            )
        node = child
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {override!r}: value is not valid YAML ({e.problem})") from None
    if value is None:  # --set key=null: unset it (its default applies)
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, but a key given twice in one mapping is an error (YAML requires
    unique keys; PyYAML would silently keep the last value)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                break
            if first is not None:
                where = f"line {line}" if first == line else f"lines {first} and {line}"
                raise ConfigError(
                    f"config file '{key_node.start_mark.name}' gives key '{key}' twice"
                    f" ({where}); keep one"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_config_file(path: str | PathLike[str]) -> dict[str, Any]:
    """The mapping in the YAML file ``path`` (an empty file is ``{}``), not validated.

    Raises:
        ConfigError: unreadable file, invalid YAML, a key given twice in one mapping, or
            not a mapping; one line naming the file.
    """
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.load(f, Loader=_UniqueKeyLoader)
    except OSError as e:
        raise ConfigError(f"cannot read config file '{path}': {e.strerror}") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file '{path}' is not valid YAML{at}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must be a mapping of keys to values")
    return data


