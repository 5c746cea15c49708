"""Install what fedax needs and this Python lacks, from carried wheels, without a network.

    python3 benchmarks/gpu/install.py --wheels benchmarks/gpu/wheels --target /tmp/site \\
        --report install.json

Reads fedax's requirements from ``pyproject.toml`` and, for each one this interpreter does not
already satisfy (``importlib.metadata``), takes the wheel of that name from ``--wheels`` and
follows its own requirements the same way. The chosen wheels are installed with
``pip install --no-index --no-deps --target TARGET``: into a folder of their own, put first
on ``PYTHONPATH`` by ``run.sh``, so nothing installed on the machine is touched or upgraded,
and jax, jaxlib, numpy, optax and torch never come from here (a requirement on them that is
not met is reported, not installed). Then fedax itself is installed from the working tree
into the same folder (``pip install --no-index --find-links WHEELS --no-deps --target``; its
build backend, setuptools, comes from the wheels). Requirements met by neither are reported
as missing, not fatal: the benchmarks import only part of fedax (a missing ``cryptography``
only matters to ``fedax.runtime``). The report (JSON) lists what was already there, what was
installed and what is missing; the exit status is 0 unless pip itself failed.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # pip's own copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[2]
NEVER = {"jax", "jaxlib", "numpy", "optax", "torch"}  # the machine's own, never replaced


def project_requirements(pyproject: Path) -> list[str]:
    try:
        import tomllib
    except ImportError:  # Python 3.10: the dependencies array, read plainly
        text = pyproject.read_text()
        block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
        return re.findall(r'^\s*"([^"]+)"', block.group(1), re.M) if block else []
    with open(pyproject, "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def wheel_index(directory: Path) -> dict[str, tuple[str, Path]]:
    """canonical name -> (version, path) of every wheel in ``directory``."""
    out = {}
    for path in sorted(directory.glob("*.whl")):
        name, version = path.name.split("-")[:2]
        out[canonicalize_name(name)] = (version, path)
    return out


def wheel_requirements(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8", "replace")
    return [line.split(":", 1)[1].strip() for line in text.splitlines()
            if line.startswith("Requires-Dist:")]


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def plan(requirements: list[str], wheels: dict[str, tuple[str, Path]]) -> dict:
    present, chosen, missing, reported = {}, {}, [], set()
    queue = [(r, "fedax") for r in requirements]
    while queue:
        text, wanted_by = queue.pop(0)
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in chosen or name in present or name in reported:
            continue
        have = installed_version(req.name)
        if have is not None and req.specifier.contains(have, prereleases=True):
            present[name] = have
            continue
        entry = wheels.get(name)
        if name not in NEVER and entry is not None and \
                req.specifier.contains(entry[0], prereleases=True):
            chosen[name] = entry
            queue += [(r, name) for r in wheel_requirements(entry[1])]
            continue
        reported.add(name)
        missing.append({"requirement": text, "wanted_by": wanted_by, "installed": have,
                        "carried": entry[0] if entry else None})
    return {"present": present, "chosen": chosen, "missing": missing}


def pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                          capture_output=True, text=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--no-fedax", action="store_true", help="dependencies only")
    args = parser.parse_args(argv)
    wheels = wheel_index(Path(args.wheels))
    result = plan(project_requirements(REPO / "pyproject.toml"), wheels)
    report = {"python": sys.version.split()[0], "executable": sys.executable,
              "present": result["present"], "missing": result["missing"],
              "installed": {n: v for n, (v, _) in result["chosen"].items()},
              "wheels_carried": {n: v for n, (v, _) in wheels.items()}}
    status = 0
    if result["chosen"]:
        out = pip("install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                  "--target", args.target, *(str(p) for _, p in result["chosen"].values()))
        report["pip_dependencies"] = {"returncode": out.returncode,
                                      "tail": (out.stdout + out.stderr)[-3000:]}
        status = status or out.returncode
    if not args.no_fedax:
        # pip builds in the tree: leave no build/ or egg-info behind that was not there
        leftovers = [p for p in (REPO / "build", REPO / "src" / "fedax.egg-info")
                     if not p.exists()]
        out = pip("install", "--no-index", "--find-links", args.wheels, "--no-deps",
                  "--no-compile", "--no-cache-dir", "--target", args.target, str(REPO))
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)
        report["pip_fedax"] = {"returncode": out.returncode,
                               "tail": (out.stdout + out.stderr)[-3000:]}
        report["fedax_installed"] = out.returncode == 0
    Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    print(f"install: {len(result['present'])} requirements present, "
          f"{len(result['chosen'])} installed from wheels "
          f"({', '.join(sorted(result['chosen'])) or 'none'}), "
          f"{len(result['missing'])} missing "
          f"({', '.join(m['requirement'] for m in result['missing']) or 'none'}); "
          f"fedax from the tree: {report.get('fedax_installed')}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
