"""Every ```python block of README.md runs as written, and the API example learns."""

import math
import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_HEADING = re.compile(r"^## (.+)$", re.M)


def _blocks() -> list[tuple[str, str]]:
    """``(section heading, code)`` of each python block, in order."""
    text = README.read_text(encoding="utf-8")
    headings = [(m.start(), m.group(1).strip()) for m in _HEADING.finditer(text)]
    return [(max([h for h in headings if h[0] < m.start()], default=(0, ""))[1], m.group(1))
            for m in _BLOCK.finditer(text)]


@pytest.fixture(scope="module")
def namespaces() -> dict[str, list[dict]]:
    """Each block executed in a fresh namespace, grouped by section heading."""
    out: dict[str, list[dict]] = {}
    for heading, code in _blocks():
        namespace: dict = {"__name__": "__readme__"}
        exec(compile(code, f"README.md ({heading})", "exec"), namespace)
        out.setdefault(heading, []).append(namespace)
    return out


def test_every_python_block_runs(namespaces):
    assert sum(len(v) for v in namespaces.values()) == len(_blocks()) >= 1


def test_the_api_example_trains_and_evaluates(namespaces):
    (example,) = namespaces["The Python API"]
    losses = example["train_losses"]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) < sum(losses[:5])  # the training loss went down
    assert example["test_loss"] < 0.6 * example["initial_loss"]  # ln 10 at the zero model
    assert example["accuracy"] > example["initial_accuracy"] + 0.3
