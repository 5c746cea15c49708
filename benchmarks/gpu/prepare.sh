#!/usr/bin/env bash
# Assemble what travels with the working tree to a GPU machine that has no network
# (benchmarks/gpu/README.md). Run where the package registries are reachable:
#
#   bash benchmarks/gpu/prepare.sh
#
# benchmarks/gpu/wheels/  wheels (CPython 3.12, manylinux x86-64) of fedax's dependencies that
#                         such a machine may lack, at the versions this checkout's .venv runs
#                         (pip download, no dependencies resolved: the list below is the closure
#                         over what that machine lacks), and setuptools (fedax's build backend)
# benchmarks/gpu/data/    fedax's data cache, gzipped: MNIST's four IDX files and Shakespeare's
#                         text (fetched into the cache first if missing)
# Both are git-ignored. It prints their sizes, the working tree's, and the sum against the
# device tool's 64 MiB limit on what travels.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
if [ -n "${PYTHON:-}" ]; then :
elif [ -x "$REPO/.venv/bin/python" ]; then PYTHON="$REPO/.venv/bin/python"
else PYTHON=python3; fi
PY_VERSION="${GPU_PYTHON_VERSION:-3.12}"   # the GPU image's Python (KINDS.md: 3.12.3)
ABI="cp${PY_VERSION/./}"
WHEELS="$HERE/wheels"
DATA="$HERE/data"

# Not on the GPU image (pydantic and its parts, platformdirs, dp-accounting and dm-tree,
# tensorboardX, cryptography and its cffi/pycparser), or small and needed at import (pyyaml,
# msgpack, tqdm, flatbuffers, protobuf, typing-extensions, packaging, absl-py, attrs, mpmath,
# wrapt): install.py installs only those that the machine does not already satisfy.
# Never carried: jax, jaxlib, numpy, optax, torch (the machine's own), and what is large and
# on that image (scipy for dp-accounting, matplotlib, grpcio).
PACKAGES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions
          platformdirs pyyaml msgpack tqdm flatbuffers dp-accounting dm-tree absl-py attrs
          mpmath wrapt tensorboardX protobuf packaging cryptography cffi pycparser)

pinned() {  # NAME==VERSION as this checkout's .venv has it, else NAME (the newest)
  "$PYTHON" - "$1" <<'EOF'
import importlib.metadata, sys
name = sys.argv[1]
try:
    print(f"{name}=={importlib.metadata.version(name)}")
except importlib.metadata.PackageNotFoundError:
    print(name)
EOF
}

rm -rf "$WHEELS"
mkdir -p "$WHEELS"
SPECS=()
for name in "${PACKAGES[@]}"; do SPECS+=("$(pinned "$name")"); done
SPECS+=("setuptools>=77")
echo "downloading ${#SPECS[@]} wheels for CPython $PY_VERSION, manylinux x86-64 ..."
PLATFORMS=()
for p in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 \
         manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
for spec in "${SPECS[@]}"; do
  "$PYTHON" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
    --python-version "$PY_VERSION" --implementation cp --abi "$ABI" --abi abi3 --abi none \
    "${PLATFORMS[@]}" -d "$WHEELS" "$spec" 2> >(grep -v "^WARNING: Location" >&2) \
    || { echo "prepare.sh: no wheel of $spec for CPython $PY_VERSION" >&2; exit 1; }
done

# What the carried wheels require that is neither carried nor on the GPU image (a check).
"$PYTHON" - "$WHEELS" <<'EOF'
import sys, zipfile
from pathlib import Path
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
on_image = {"jax", "jaxlib", "numpy", "optax", "torch", "scipy", "matplotlib", "grpcio"}
wheels = list(Path(sys.argv[1]).glob("*.whl"))
carried = {canonicalize_name(w.name.split("-")[0]) for w in wheels}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
       "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "extra": ""}
unresolved = set()
for w in wheels:
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                if req.marker is None or req.marker.evaluate(env):
                    name = canonicalize_name(req.name)
                    if name not in carried and name not in on_image:
                        unresolved.add(f"{name} (for {w.name.split('-')[0]})")
print("requirements of the wheels neither carried nor on the GPU image:",
      ", ".join(sorted(unresolved)) or "none")
EOF

# The data cache, gzipped (fetched into fedax's cache first where missing).
rm -rf "$DATA"
mkdir -p "$DATA"
"$PYTHON" - "$DATA" <<'EOF'
import gzip, shutil, sys
from pathlib import Path
from fedax.data import fetch_mnist, fetch_shakespeare
out = Path(sys.argv[1])
from fedax.data.mnist import SHA256 as MNIST_FILES
mnist = Path(fetch_mnist())
shakespeare = Path(fetch_shakespeare())  # the text file itself
for name, files in (("mnist", [mnist / f for f in sorted(MNIST_FILES)]),
                    ("shakespeare", [shakespeare])):
    (out / name).mkdir(parents=True, exist_ok=True)
    for path in files:
        with open(path, "rb") as src, gzip.GzipFile(
                out / name / f"{path.name}.gz", "wb", compresslevel=9, mtime=0) as dst:
            shutil.copyfileobj(src, dst)
EOF

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
bytes_of() { du -sb "$1" | cut -f1; }
W=$(bytes_of "$WHEELS"); D=$(bytes_of "$DATA")
cd "$REPO"
TREE=$(git ls-files -z -co --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
       | awk '{ s += $1 } END { print s + 0 }')
echo "wheels: $(ls "$WHEELS" | wc -l) files, $(mib "$W")  ($WHEELS)"
for d in "$DATA"/*/; do echo "data/$(basename "$d"): $(mib "$(bytes_of "$d")")"; done
echo "carried (wheels + data): $(mib $((W + D)))"
echo "working tree (tracked and untracked files, not ignored): $(mib "$TREE")"
echo "what travels in all: $(mib $((W + D + TREE))) of the device tool's 64 MiB"
if [ $((W + D)) -gt $((60 * 1048576)) ] || [ $((W + D + TREE)) -gt $((64 * 1048576)) ]; then
  echo "prepare.sh: too large to travel" >&2
  exit 1
fi
