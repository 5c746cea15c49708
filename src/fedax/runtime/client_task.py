"""A client's side of the task: its round batches from its own examples
(``local_batches``) and what it builds from the task it joined (``built``: the algorithm's
pieces, the templates of what it receives and the compiled client steps, once per process
and task, so client stubs sharing a process share one compilation).
"""

from __future__ import annotations

import functools
import threading

import numpy as np


def local_batches(x: np.ndarray, y: np.ndarray, local_epochs: int, batch_size: float,
                  seed: int, t: int, client_id: int, num_steps: int | None = None):
    """Client ``client_id``'s batches for round t from its own examples: ``(x [S, B, ...],
    y [S, B, ...], mask [S, B], n_k)`` as NumPy (x float32, or int32 token ids; y int32),
    shuffled with ``default_rng([seed, t, client_id])`` (``fedax.data.make_cohort`` on a
    one-client ``ClientData``), the simulator's per-client stream."""
    from fedax.data import ClientData, make_cohort

    n = len(y)
    data = ClientData(x, y, np.arange(n, dtype=np.int64), np.array([0, n], np.int64))
    cohort = make_cohort(data, np.array([0]), local_epochs, batch_size,
                         np.random.default_rng([seed, t, client_id]), num_steps=num_steps)
    idx, mask = cohort.idx[0], cohort.mask[0]
    x = np.asarray(x)
    dtype = np.int32 if np.issubdtype(x.dtype, np.integer) else np.float32
    return (x[idx].astype(dtype), np.asarray(y)[idx].astype(np.int32), mask,
            np.float32(cohort.num_examples[0]))


BUILD_LOCK = threading.Lock()


def built(task_json: str):
    """The task's pieces, templates and compiled steps (``_build``) for ``task_json``, built
    once per process and task, whichever client thread asks first."""
    with BUILD_LOCK:
        return _build(task_json)


@functools.lru_cache(maxsize=8)
def _build(task_json: str):
    """The task's pieces, templates and compiled client step (once per process and task,
    so client stubs sharing a process share one compilation)."""
    import jax

    from fedax.runtime import store
    from fedax.runtime.secure_task import secure_steps
    from fedax.runtime.task import (
        Task,
        build,
        client_step,
        encodes,
        key_data_template,
        payload_template,
    )

    task = Task.from_json(task_json)
    made = build(task)
    pieces = made.pieces
    staged = encodes(task) or pieces.aggregator.secure is not None  # it runs the stage
    template = payload_template(pieces, made.params, staged)
    step = jax.jit(functools.partial(client_step, pieces))
    state_template = None
    if pieces.client_state is not None:
        state_template = jax.eval_shape(pieces.client_state, made.params)
    from fedax.runtime.holdout import eval_step, holdout_step, holdout_template

    sent_params = holdout_template(made.params)
    holdout = {"eval_sent": {"payload": {"params": sent_params["payload"]["params"]}},
               "eval_step": jax.jit(functools.partial(eval_step, made.apply))}
    if made.learned is not None:
        holdout.update(holdout_sent=sent_params,
                       holdout_step=jax.jit(functools.partial(holdout_step, made.loss)))
    return {"task": task, "pieces": pieces, "params": made.params, **holdout,
            "sent": store.raw_template(template), "sent_typed": template,
            "key": key_data_template(), "step": step, "state_template": state_template,
            **secure_steps(task, pieces, made.params)}
