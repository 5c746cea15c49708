"""The version a user sees is the changelog's newest: pyproject.toml, fedax.__version__ and
CHANGELOG.md's first entry agree, and the package ships its type hints (py.typed)."""

import pathlib
import re

import fedax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_version_is_the_newest_changelog_entry():
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(),
                        flags=re.MULTILINE).group(1)
    entries = re.findall(r"^## (\d+\.\d+\.\d+)\b", (ROOT / "CHANGELOG.md").read_text(),
                         flags=re.MULTILINE)
    assert entries, "CHANGELOG.md has no '## X.Y.Z' entry"
    assert version == entries[0] == fedax.__version__
    ordered = [tuple(int(p) for p in e.split(".")) for e in entries]
    assert ordered == sorted(ordered, reverse=True)  # newest first


def test_the_package_ships_its_type_hints():
    data = re.search(r"^\[tool\.setuptools\.package-data\]\nfedax = (.*)$",
                     (ROOT / "pyproject.toml").read_text(), flags=re.MULTILINE).group(1)
    assert '"py.typed"' in data
    assert (ROOT / "src" / "fedax" / "py.typed").exists()
