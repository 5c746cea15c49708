"""Test configuration: 8 virtual CPU devices, float32 by default.

The XLA flag must be set before jax is imported anywhere, so it comes first.
"""

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()

# The suite compiles thousands of small programs and runs each for milliseconds: LLVM's
# expensive optimization passes (which keep IEEE float semantics) cost more than they save
# here (test_runner.py cold: 70 s against 86 s). FEDAX_TEST_FAST_COMPILE=0 keeps them;
# the fedax subprocesses the tests start inherit the flag (``_child_env``). (LLVM's backend
# optimization level 0 would take a sixth more off, but it changes the float order of a
# client's step against the simulator's round: a networked MNIST run then differs from the
# simulated one by 3e-5, past the 1e-6 the engines' equality tests hold them to.)
# XLA's older loop emitters for fusions compile faster than its MLIR fusion emitters
# (a quarter off the compile-heavy tests: 123 s against 166 s cold) and keep the same float
# semantics; the engines' equality tests hold under both.
_COMPILE_FLAGS = {"xla_llvm_disable_expensive_passes": "true",
                  "xla_cpu_use_fusion_emitters": "false"}
if os.environ.get("FEDAX_TEST_FAST_COMPILE", "1") != "0":
    for _flag, _value in _COMPILE_FLAGS.items():
        if _flag not in os.environ["XLA_FLAGS"]:
            os.environ["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} --{_flag}={_value}"

# One persistent XLA compilation cache for the whole suite, the fedax subprocesses it starts
# included (they inherit the environment): many tests compile the same round program, and a
# cached executable is the very program a fresh compile gives. FEDAX_TEST_JAX_CACHE=0 turns
# it off; the cache directory is git-ignored.
if os.environ.get("FEDAX_TEST_JAX_CACHE", "1") != "0":
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax-cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    # The xdist workers and their fedax subprocesses share it without a lock (JAX locks only
    # a size-bounded cache, and then lists every entry at each write): a program has one key
    # and one content, and an entry read while another process writes it fails to decompress,
    # which JAX reports as a warning and answers by compiling (jax._src.compiler._cache_read).

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)


def _child_env() -> dict[str, str]:
    """The environment for a fedax subprocess: the device count flag (and FEDAX_DEVICES)
    removed, so the child chooses its own, every other XLA flag kept (e.g.
    ``--xla_cpu_max_isa=AVX2``, under which the suite also runs)."""
    env = {k: v for k, v in os.environ.items() if k not in ("FEDAX_DEVICES", "FEDAX_DEBUG")}
    flags = [f for f in env.pop("XLA_FLAGS", "").split()
             if "xla_force_host_platform_device_count" not in f]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env


TINY_CONFIG = """\
rounds: 2
dataset: synthetic
num_clients: 12
model: logistic
algorithm: fedavg
client_fraction: 0.5
local_epochs: 1
batch_size: 10
client_lr: 0.05
execution:
  devices: 1
"""
"""A run that takes seconds: Synthetic(α, β) with 12 clients and a logistic model."""


def run_fedax(*args, cwd, timeout=180):
    """``fedax ARGS`` in a fresh process, as a user runs it (see ``_child_env``)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "fedax.cli.main", *args], cwd=cwd,
                          env=_child_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def child_env():
    """See ``_child_env``."""
    return _child_env()


@pytest.fixture
def mesh():
    """An 8-device mesh with one axis named 'clients' (jax's default axis types)."""
    return jax.make_mesh((8,), ("clients",))


@pytest.fixture(scope="module")
def small_mnist():
    """Real MNIST, small: 2,000 training examples over 20 IID clients, 1,000 test examples
    (train, x_test, y_test). Modules with other needs define their own."""
    from fedax import data as fdata

    arrays = fdata.load_mnist()
    x, y = arrays["x_train"][:2000], arrays["y_train"][:2000]
    train = fdata.ClientData.from_partition(x, y, fdata.iid(len(y), 20, seed=0))
    return train, arrays["x_test"][:1000], arrays["y_test"][:1000]


# FEDAX_TEST_PROFILE=FILE appends one JSON line per test phase to FILE: its wall time and the
# seconds JAX spent tracing, lowering and compiling in it (jax.monitoring), to find where the
# suite's time goes. Off by default.
if os.environ.get("FEDAX_TEST_PROFILE"):
    import collections
    import json
    import time

    _spent: collections.Counter = collections.Counter()
    def _record(event, duration, **_):
        name = event.rsplit("/", 1)[-1]
        _spent.update({name: duration, f"{name}_count": 1})
        if name == "backend_compile_duration" and duration < 0.2:  # not persistently cached
            _spent.update({"small_compile_duration": duration, "small_compile_count": 1})

    jax.monitoring.register_event_duration_secs_listener(_record)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _spent.clear()
        start = time.perf_counter()
        yield
        record = {"test": item.nodeid, "wall": time.perf_counter() - start, **_spent}
        with open(os.environ["FEDAX_TEST_PROFILE"], "a") as f:
            f.write(json.dumps(record) + "\n")
