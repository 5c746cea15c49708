"""The machine a GPU run ran on, as JSON on stdout: JAX's backend and devices (with the
allocator's limit), PyTorch's CUDA view, the versions that matter, fedax's source, the host
(CPU, cores, memory) and ``nvidia-smi``'s report where it exists.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/gpu/machine.py
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import common  # noqa: E402

PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
            "jax-cuda12-pjrt", "optax", "numpy", "torch", "pydantic", "pydantic-core",
            "msgpack", "pyyaml", "dp-accounting", "fedax")


def _versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0], "executable": sys.executable}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _jax() -> dict:
    import jax

    import fedax

    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind,
        "device_count": jax.device_count(),
        "memory": common.jax_device_memory(),
        "default_matmul_precision": str(jax.config.jax_default_matmul_precision),
        "fedax": {"version": fedax.__version__, "file": fedax.__file__},
    }


def _torch() -> dict:
    if importlib.util.find_spec("torch") is None:
        return {"available": False, "why": "torch is not importable here"}
    import torch

    out = {"available": True, "version": torch.__version__,
           "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(device=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version(),
                   total_memory=int(props.total_memory),
                   multiprocessors=int(props.multi_processor_count),
                   matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                   cudnn_allow_tf32=torch.backends.cudnn.allow_tf32)
    return out


def _nvidia_smi() -> dict | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = {}
    for key, args in (("query", ["--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
                                 "clocks.max.mem,power.limit,pstate", "--format=csv"]),
                      ("report", [])):
        try:
            done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True,
                                  timeout=20)
            out[key] = (done.stdout or done.stderr).strip()
        except (OSError, subprocess.TimeoutExpired) as err:
            out[key] = f"failed: {err}"
    return out


def main() -> int:
    info = {"host": common.machine_info(), "versions": _versions()}
    try:
        info["jax"] = _jax()
    except Exception as err:  # reported, not fatal: the parts say what they can run
        info["jax"] = {"error": f"{type(err).__name__}: {err}"}
    try:
        info["torch"] = _torch()
    except Exception as err:
        info["torch"] = {"available": False, "why": f"{type(err).__name__}: {err}"}
    info["nvidia_smi"] = _nvidia_smi()
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
