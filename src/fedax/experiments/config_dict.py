"""A config as the JSON dict that ``summary.json`` and a checkpoint's fingerprint hold,
in the form configs had before their newer keys existed: a section or key that is off is
left out, so an older run's saved config and this dump compare equal (its resume, its
finished-run check) and a config validates back from its dict."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedax.experiments.sections import ClientConfig

if TYPE_CHECKING:  # config imports this module
    from fedax.experiments.config import Config


def config_to_dict(config: Config) -> dict[str, Any]:
    """A JSON-serializable dict of ``config``, a ``fedax.experiments.config.Config`` (B = inf
    as ``"inf"``); it validates back.
    ``learned_lr`` appears only with ``server.lr: learned`` (it applies only then), and
    ``privacy``, ``compression``, ``robust``, ``secure`` and ``attack`` only when given, and
    ``per_client_eval`` only when on, ``client`` only with early stopping, and
    ``execution.mode`` and ``asynchronous`` only with ``mode: async``, ``network`` only
    with ``mode: network`` (configs written before they existed dump as before)."""
    data = config.model_dump(mode="json")
    if not config.per_client_eval:
        data.pop("per_client_eval")
    if config.client == ClientConfig():
        data.pop("client")
    else:  # only the keys given (an absent key is its default)
        data["client"] = {k: v for k, v in data["client"].items() if v is not None}
    if config.server.lr != "learned":
        data.pop("learned_lr")
    if not config.algorithm_options:
        data.pop("algorithm_options")
    if config.privacy is None:
        data.pop("privacy")
    if config.compression is None:
        data.pop("compression")
    for section in ("robust", "attack", "secure"):
        if getattr(config, section) is None:
            data.pop(section)
    if config.execution.mode == "sync":  # the default engine dumps as before it had a name
        data["execution"].pop("mode")
    if config.execution.mode != "async" and not (config.execution.mode == "network"
                                                 and config.network.asynchronous):
        data.pop("asynchronous")
    if config.execution.mode != "network":
        data.pop("network")
    return data
