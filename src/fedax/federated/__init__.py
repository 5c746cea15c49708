"""Placement primitives, their communication cost and the audit of what they reveal (the
lowest layer of fedax)."""

from fedax.federated import _secure as secure
from fedax.federated._audit import (
    SumAudit,
    audit_sums,
    audit_table,
    unprivatized_sums,
    unsecured_sums,
)
from fedax.federated._comm import CommCost, comm_cost
from fedax.federated._dp import dp_clip, dp_noise
from fedax.federated._lockstep import balance_devices, lockstep_axis, lockstep_width
from fedax.federated._map import (
    ClientMapper,
    current_map_strategy,
    fuse_sums,
    map_and_sum,
    map_clients,
    map_strategy,
)
from fedax.federated._primitives import (
    CLIENTS_AXIS,
    broadcast,
    broadcast_p,
    collect,
    collect_p,
    distribute,
    distribute_p,
    divide_by_weight,
    mean,
    sum,
    sum_p,
    weighted_mean,
    weighted_terms,
)
from fedax.federated._secure import (
    SecureSum,
    modular_sum,
    modular_sum_p,
    secure_broadcast,
    secure_broadcast_p,
    secure_sum,
    secure_sum_p,
)

__all__ = [
    "CLIENTS_AXIS",
    "ClientMapper",
    "CommCost",
    "SecureSum",
    "SumAudit",
    "audit_sums",
    "audit_table",
    "balance_devices",
    "broadcast",
    "broadcast_p",
    "collect",
    "collect_p",
    "comm_cost",
    "current_map_strategy",
    "distribute",
    "distribute_p",
    "divide_by_weight",
    "dp_clip",
    "dp_noise",
    "fuse_sums",
    "lockstep_axis",
    "lockstep_width",
    "map_and_sum",
    "map_clients",
    "map_strategy",
    "mean",
    "modular_sum",
    "modular_sum_p",
    "secure",
    "secure_broadcast",
    "secure_broadcast_p",
    "secure_sum",
    "secure_sum_p",
    "sum",
    "sum_p",
    "unprivatized_sums",
    "unsecured_sums",
    "weighted_mean",
    "weighted_terms",
]
