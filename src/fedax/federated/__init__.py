"""Placement primitives and their communication cost (the lowest layer of fedax)."""

from fedax.federated._comm import CommCost, comm_cost
from fedax.federated._primitives import (
    CLIENTS_AXIS,
    ClientMapper,
    broadcast,
    broadcast_p,
    collect,
    collect_p,
    current_map_strategy,
    distribute,
    distribute_p,
    map_clients,
    map_strategy,
    mean,
    sum,
    sum_p,
    weighted_mean,
)

__all__ = [
    "CLIENTS_AXIS",
    "CommCost",
    "broadcast",
    "broadcast_p",
    "collect",
    "collect_p",
    "comm_cost",
    "distribute",
    "distribute_p",
    "ClientMapper",
    "current_map_strategy",
    "map_clients",
    "map_strategy",
    "mean",
    "sum",
    "sum_p",
    "weighted_mean",
]
