"""The builder: from a validated config (``fedax.spec``) to the pieces a run needs, the
same for every engine: the federated data set (``datasets.build_data``), the algorithm and
its aggregator chain (``build.build``, the one builder, for a config and for a runtime
``Task``), the privacy plan and its accountant (``privacy_plan.privacy_plan``), the secure
aggregator (``secure_plan``), the asynchronous settings (``asynchronous``) and the attack
and compression plans (``features``). The simulator's driver, the runtime and the
networked clients call it.

The names below load on first use (PEP 562); ``build`` and ``privacy_plan`` share their
modules' names, so they are reached through them (``fedax.builder.build.build``)."""

from __future__ import annotations

from fedax._lazy import lazy_getattr

_NAMES = {  # name -> the module that defines it
    "Built": "fedax.builder.build", "FederatedData": "fedax.builder.datasets",
    "PrivacyPlan": "fedax.builder.privacy_plan", "async_settings": "fedax.builder.asynchronous",
    "build_algorithm": "fedax.builder.build", "build_data": "fedax.builder.datasets",
    "secure_aggregator": "fedax.builder.secure_plan",
}

__getattr__ = lazy_getattr(__name__, _NAMES)
__all__ = sorted(_NAMES)
