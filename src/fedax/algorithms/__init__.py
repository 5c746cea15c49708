"""Federated algorithms as ``FederatedAlgorithm(init, round, server_params)``."""

from fedax.algorithms.base import CohortBatches, FederatedAlgorithm
from fedax.algorithms.fedavg import FedAvgState, fedavg
from fedax.algorithms.fedsgd import fedsgd

__all__ = ["CohortBatches", "FedAvgState", "FederatedAlgorithm", "fedavg", "fedsgd"]
