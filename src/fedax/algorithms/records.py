"""A round's record as strict JSON, for every engine that writes one.

A round's metrics can be NaN or infinite (a diverged run); ``json.dumps`` would write them
as ``NaN``/``Infinity``, which is not JSON. Every writer of records (the runner's
``metrics.jsonl`` and ``summary.json``, ``fedax.experiments.outputs``; the runtime server's
``rounds.jsonl``) writes ``strict_json(record)`` with ``dumps``: a non-finite value becomes
null, and one that slips through raises. It lives here, below ``simulation`` and
``runtime``, so that both, and ``experiments`` above them, use the same one (docs/design.md,
"Layers").
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np


def strict_json(value: Any) -> tuple[Any, bool]:
    """``value`` with every non-finite float (NaN, inf) replaced by None, and whether there
    was one; dicts, lists and tuples are walked."""
    if isinstance(value, (float, np.floating)):
        return (float(value), False) if math.isfinite(value) else (None, True)
    if isinstance(value, dict):
        items = {k: strict_json(v) for k, v in value.items()}
        return {k: v for k, (v, _) in items.items()}, any(bad for _, bad in items.values())
    if isinstance(value, (list, tuple)):
        items = [strict_json(v) for v in value]
        return [v for v, _ in items], any(bad for _, bad in items)
    return value, False


def dumps(value: Any, **kwargs: Any) -> str:
    """JSON text of ``value``; a non-finite float raises (sanitize with ``strict_json``)."""
    return json.dumps(value, allow_nan=False, **kwargs)
