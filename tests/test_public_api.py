"""Every package's ``__all__`` is its public API, and its page under docs/api renders it.

For each package under src/fedax: ``__all__`` exists; each name in it is importable from
the package and not private; every public name the package's ``__init__.py`` binds (a
definition, an import from its own modules, or a lazily loaded name of its ``_NAMES``) is
listed;
and the page ``docs/api/<package>.md`` (a subpackage's: its top package's page) has a
``::: fedax.<package>`` directive and documents each name of ``__all__``.

What a ``::: fedax.x`` directive renders without a ``members`` option is ``__all__``
exactly: mkdocs.yml's mkdocstrings options render a name without a docstring too and drop
names with a leading underscore, an
imported name renders only when ``__all__`` lists it (griffe's ``is_public``), a name
defined in the ``__init__.py`` renders unless private (so it must be listed: checked here),
and submodules do not render (``show_submodules`` is off; a name of ``__all__`` that is
also its defining module's name, like ``fedax.algorithms.fedavg``, is read as the module,
so it has a ``::: <module>.<name>`` directive of its own). A directive with ``members:
false`` renders none of them: a lazily loading package's page (``fedax.runtime``) documents
each name in the module that defines it, so the name must appear in a ``members`` list of
a ``::: fedax.x.<module>`` directive, or as ``::: fedax.x.<module>.<name>``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import types
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "fedax"
PACKAGES = sorted(
    ".".join(("fedax", *init.parent.relative_to(SRC).parts))
    for init in SRC.rglob("__init__.py"))
SUBPACKAGES = [p for p in PACKAGES if p != "fedax"]


def _init_file(package: str) -> Path:
    return SRC.joinpath(*package.split(".")[1:], "__init__.py")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _bound_names(package: str) -> set[str]:
    """The public names ``__init__.py`` binds at its top level: its definitions and what it
    imports from its own modules (modules, and names from elsewhere, e.g. ``typing`` or
    another fedax package, are its helpers; ``if TYPE_CHECKING:`` blocks bind nothing)."""
    names: set[str] = set()
    for node in ast.parse(_init_file(package).read_text()).body:
        if isinstance(node, ast.ImportFrom):
            absolute = node.module if node.level == 0 else package
            if absolute and (absolute + ".").startswith(package + "."):
                names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    module = importlib.import_module(package)
    return {n for n in names if not n.startswith("_")
            and not isinstance(getattr(module, n, None), types.ModuleType)}


def _lazy_names(module: types.ModuleType) -> set[str]:
    """The names a PEP 562 ``__getattr__`` loads on first use, by fedax's convention a
    module-level ``_NAMES`` mapping of name -> defining module."""
    names = getattr(module, "_NAMES", None)
    return set(names) if isinstance(names, dict) and hasattr(module, "__getattr__") else set()


def _is_module(path: str) -> bool:
    try:
        return importlib.util.find_spec(path) is not None
    except (ImportError, ValueError):  # a parent that is a module, not a package
        return False


def _shadowed(package: str) -> dict[str, str]:
    """Names of ``__all__`` that share their name with the module defining them
    (``fedax.algorithms.fedavg``, function and module): griffe reads such a name as the
    module, which does not render in the package's directive. Name -> the object's path."""
    module = importlib.import_module(package)
    shadowed = {}
    for name in getattr(module, "__all__", ()):
        value = getattr(module, name)
        where = getattr(value, "__module__", None)
        if isinstance(value, types.ModuleType) or where is None:
            continue
        if _is_module(f"{package}.{name}") or where.rpartition(".")[2] == name:
            shadowed[name] = f"{where}.{name}"
    return shadowed


def _rendered(target: str) -> set[str]:
    """The names a ``::: target`` directive without ``members`` documents: a module's
    ``__all__``, else its public names defined in it; an object, its own name."""
    try:
        module = importlib.import_module(target)
    except ImportError:
        return {target.rpartition(".")[2]}
    if hasattr(module, "__all__"):
        return set(module.__all__)
    return {n for n, v in vars(module).items() if not n.startswith("_")
            and getattr(v, "__module__", None) == target}


def _directives(page: Path) -> dict[str, object]:
    """``target -> members option`` (None when absent) of a page's ``::: target`` lines."""
    found: dict[str, object] = {}
    lines = page.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("::: "):
            continue
        block = []
        for following in lines[i + 1:]:
            if following and not following.startswith(" "):
                break
            block.append(following)
        options = (yaml.safe_load("\n".join(block)) or {}).get("options", {}) if block else {}
        found[line[4:].strip()] = options.get("members")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_all_lists_the_packages_public_names(package):
    module = importlib.import_module(package)
    exported = getattr(module, "__all__", None)
    assert isinstance(exported, (list, tuple)), f"{package} has no __all__"
    assert all(isinstance(n, str) for n in exported), f"{package}.__all__ holds a non-str"
    assert len(set(exported)) == len(exported), f"{package}.__all__ lists a name twice"
    private = [n for n in exported if _private(n)]
    assert not private, f"{package}.__all__ lists private names {private}"
    missing = [n for n in exported if not hasattr(module, n)]
    assert not missing, f"{package}.__all__ lists {missing}, which {package} does not have"
    unlisted = sorted((_bound_names(package) | _lazy_names(module)) - set(exported))
    assert not unlisted, f"{package} has public names {unlisted} missing from its __all__"


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_the_api_page_documents_the_package_and_its_all(package):
    page = ROOT / "docs" / "api" / f"{package.split('.')[1]}.md"
    assert page.is_file(), f"{package} has no page {page.relative_to(ROOT)}"
    directives = _directives(page)
    assert package in directives, f"{page.relative_to(ROOT)} has no '::: {package}'"
    module = importlib.import_module(package)
    exported = set(getattr(module, "__all__", ()))  # its absence fails the test above
    # A module of __all__ (a namespace, e.g. fedax.federated.secure) has a directive of its
    # own: submodules do not render in their package's.
    modules = {n for n in exported if isinstance(getattr(module, n), types.ModuleType)}
    alone = sorted(n for n in modules if f"{package}.{n}" not in directives)
    assert not alone, f"{page.relative_to(ROOT)} has no directive for the modules {alone} " \
                      f"of {package}.__all__"
    shadowed = _shadowed(package)
    alone = sorted(n for n, path in shadowed.items() if path not in directives)
    assert not alone, f"{page.relative_to(ROOT)} needs '::: {shadowed[alone[0]]}' for " \
                      f"{alone} of {package}.__all__, which share a module's name"
    own = directives[package]
    if own is None or own is True:  # renders __all__ (see the module docstring)
        return
    documented = set(own or []) | modules
    extra = documented - exported
    assert not extra, f"{page.relative_to(ROOT)} documents {sorted(extra)} of {package}, " \
                      "which its __all__ does not list"
    for target, members in directives.items():
        if target.startswith(package + "."):  # a module's members, or one object
            documented |= set(members) if isinstance(members, list) else _rendered(target)
    undocumented = sorted(exported - documented)
    assert not undocumented, f"{page.relative_to(ROOT)} does not document {undocumented} " \
                             f"of {package}.__all__"


def test_mkdocs_renders_all_and_no_submodules():
    """The handler options the page checks above rely on."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)  # !!python/name etc.
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)
    plugin = next(p["mkdocstrings"] for p in config["plugins"]
                  if isinstance(p, dict) and "mkdocstrings" in p)
    options = plugin["handlers"]["python"]["options"]
    assert options.get("filters") in (["!^_"], "public")
    assert options.get("show_if_no_docstring"), "an undocumented name of __all__ would not render"
    assert "members" not in options and not options.get("show_submodules", False)
    pages = {page for entry in _nav_pages(config["nav"]) for page in [entry]}
    for package in SUBPACKAGES:
        assert f"api/{package.split('.')[1]}.md" in pages, f"mkdocs.yml nav lacks {package}"


def _nav_pages(nav):
    for entry in nav:
        if isinstance(entry, str):
            yield entry
        else:
            for value in entry.values():
                yield from ([value] if isinstance(value, str) else _nav_pages(value))
