"""Data sources with verified caching, partitioners, client data and cohort batching."""

from fedax.data._cache import DataUnavailableError, resolve_cache_dir
from fedax.data.client_data import (
    ClientData,
    Cohort,
    bucket_size,
    make_cohort,
    num_local_steps,
    sample_clients,
)
from fedax.data.mnist import fetch_mnist, load_mnist
from fedax.data.partition import iid, pathological, unbalanced

__all__ = [
    "ClientData",
    "Cohort",
    "DataUnavailableError",
    "bucket_size",
    "fetch_mnist",
    "iid",
    "load_mnist",
    "make_cohort",
    "num_local_steps",
    "pathological",
    "resolve_cache_dir",
    "sample_clients",
    "unbalanced",
]
