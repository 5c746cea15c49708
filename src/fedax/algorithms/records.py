"""A round's record as strict JSON, for every engine that writes one.

A round's metrics can be NaN or infinite (a diverged run); ``json.dumps`` would write them
as ``NaN``/``Infinity``, which is not JSON. Every writer of records (the runner's
``metrics.jsonl`` and ``summary.json``, ``fedax.experiments.outputs``; the runtime server's
``rounds.jsonl``) writes ``dumps(strict_json(record)[0])``: a non-finite value becomes
null, and one that slips through raises. Both are ``fedax.io``'s (``finite_json`` and
``json_text``), the layer below ``simulation`` and ``runtime``, under the names their
writers use.
"""

from __future__ import annotations

from fedax.io import finite_json as strict_json
from fedax.io import json_text as dumps

__all__ = ["dumps", "strict_json"]
