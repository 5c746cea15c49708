"""The ``compression`` paper's own logic (``papers/compression.yaml``): the bytes of one
client's message under each scheme, and Suresh et al.'s distributed mean estimation."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from fedax.reproduce.paper import Paper
from fedax.reproduce.sweep import run_grids


def message_bytes(section: Mapping[str, Any] | None, seed: int = 0) -> int:
    """Bytes one client sends a round under the config's ``compression`` ``section`` (None:
    the float32 update), its float32 weight included, for the 2NN."""
    import jax

    from fedax.aggregators import make_compressor
    from fedax.aggregators import message_bytes as code_bytes
    from fedax.models import get_model

    template = jax.eval_shape(get_model("2nn").init, jax.random.key(0))
    if section is None:
        return 4 * sum(math.prod(a.shape) for a in jax.tree.leaves(template)) + 4
    options = {k: v for k, v in section.items() if k not in ("scheme", "error_feedback")}
    code = make_compressor(section["scheme"], seed=seed, **options)
    assert code is not None  # a section's scheme is never "none" (the config's schemes)
    return code_bytes(code, template) + 4


def mean_estimation(dim: int = 1 << 14, clients: int = 10, trials: int = 20,
                    bits: Sequence[int] = (1, 2, 4), seed: int = 0) -> list[dict[str, Any]]:
    """Suresh et al.'s setting: ``clients`` vectors of ``dim`` coordinates (N(0, 1) with 8
    coordinates ×30) quantized to b bits by ``compressed(rotation(b))``, with and without the
    rotation; the server mean's squared error over ``trials`` draws, relative to ‖mean‖²."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fedax.aggregators import aggregate, compressed, rotation

    x = np.random.default_rng(seed).normal(size=(clients, dim)).astype(np.float32)
    x[:, :8] *= 30
    values = {"v": jnp.asarray(x)}
    truth = values["v"].mean(0)
    rows = []
    for b in bits:
        row: dict[str, Any] = {"bits": b}
        for rotate in (False, True):
            agg = compressed(rotation(b, rotate=rotate))
            run = jax.jit(lambda k, s, agg=agg: aggregate(agg, values, jnp.ones(clients), s,
                                                          k)[0]["v"])
            errors = [float(jnp.sum((run(jax.random.key(t), jax.random.key_data(
                jax.random.key(1000 + t)) if rotate else agg.init(values)) - truth) ** 2))
                for t in range(trials)]
            row["rotated" if rotate else "plain"] = float(np.mean(errors)) / float(
                jnp.sum(truth**2))
        row["improvement"] = row["plain"] / row["rotated"]
        rows.append(row)
    return rows


def run(paper: Paper, settings: Mapping[str, Any], out: Path, *, progress: bool,
        log: Callable[[str], None]) -> dict[str, Any]:
    """The paper's runs (each scored over the subset's ``last_k`` evaluations), each
    scheme's message bytes and the mean-estimation table."""
    runs = run_grids(replace(paper, last_k=settings["last_k"]), settings, out,
                     progress=progress, log=log)
    return {"settings": dict(settings), "runs": runs,
            "message_bytes": {label: message_bytes(s) for label, s in settings["schemes"]},
            "mean_estimation": mean_estimation(**settings["mean_estimation"])}
