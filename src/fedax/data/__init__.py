"""Data sources with verified caching, partitioners, client data and cohort batching, virtual
populations, label corruption and 8-bit feature encodings."""

from fedax.data._cache import DataUnavailableError, resolve_cache_dir
from fedax.data.byte_coded import BYTE_SCALE_TABLE, ByteCoded
from fedax.data.client_data import (
    ClientData,
    Cohort,
    bucket_size,
    make_cohort,
    num_local_steps,
    sample_clients,
)
from fedax.data.corruption import MISLABEL_MODES, mislabel_clients
from fedax.data.fashion_mnist import fetch_fashion_mnist, load_fashion_mnist
from fedax.data.fetch import DATASET_NAMES, fetch_dataset
from fedax.data.mnist import fetch_mnist, load_mnist
from fedax.data.partition import dirichlet, iid, pathological, similarity, unbalanced
from fedax.data.shakespeare import fetch_shakespeare, load_shakespeare
from fedax.data.synthetic import synthetic
from fedax.data.virtual_population import VirtualPopulation, sample_cohort

__all__ = [
    "BYTE_SCALE_TABLE",
    "DATASET_NAMES",
    "MISLABEL_MODES",
    "ByteCoded",
    "ClientData",
    "Cohort",
    "DataUnavailableError",
    "VirtualPopulation",
    "bucket_size",
    "dirichlet",
    "fetch_dataset",
    "fetch_fashion_mnist",
    "fetch_mnist",
    "fetch_shakespeare",
    "iid",
    "load_fashion_mnist",
    "load_mnist",
    "load_shakespeare",
    "make_cohort",
    "mislabel_clients",
    "num_local_steps",
    "pathological",
    "resolve_cache_dir",
    "sample_clients",
    "sample_cohort",
    "similarity",
    "synthetic",
    "unbalanced",
]
