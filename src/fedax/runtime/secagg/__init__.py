"""Secure aggregation: SecAgg+ (Bell et al., CCS 2020) over SecAgg (Bonawitz et al., CCS
2017), transport-agnostic, in Python, NumPy and ``cryptography`` (no JAX).

The server learns the sum mod 2^bits of the surviving clients' integer vectors and
nothing else about any one of them, as long as the drop-outs leave t shares of every
secret it needs. ``SecAggClient`` and ``SecAggServer`` are the two state machines, one
method per stage; ``fedax.runtime.secagg.messages`` turns what they exchange into bytes;
``run_round`` plays a whole round in one process.

* ``shamir``: t-of-n secret sharing of byte strings over GF(2^127 - 1);
* ``crypto``: X25519 + HKDF-SHA256, AES-256-GCM, the ChaCha20 mask PRG;
* ``graph``: the shuffled ring graph of degree k - 1;
* ``identity``: the clients' Ed25519 identity keys and the ``Roster`` (the consistency
  check against a lying server);
* ``params``, ``protocol``, ``messages``, ``simulate``: the round itself.
"""

from fedax.runtime.secagg.errors import SecAggAbort, SecAggError
from fedax.runtime.secagg.graph import default_num_shares, ring_graph
from fedax.runtime.secagg.identity import IdentityKey, Roster
from fedax.runtime.secagg.messages import (
    EncryptedShares,
    KeyDirectory,
    MaskedVector,
    PublicKeys,
    Setup,
    ShareBundle,
    ShareDelivery,
    SurvivorSet,
    SurvivorSignature,
    UnmaskRequest,
    UnmaskShares,
)
from fedax.runtime.secagg.params import SecAggParams
from fedax.runtime.secagg.protocol import SecAggClient, SecAggServer
from fedax.runtime.secagg.simulate import Transcript, run_round

__all__ = [
    "EncryptedShares",
    "IdentityKey",
    "KeyDirectory",
    "MaskedVector",
    "PublicKeys",
    "Roster",
    "SecAggAbort",
    "SecAggClient",
    "SecAggError",
    "SecAggParams",
    "SecAggServer",
    "Setup",
    "ShareBundle",
    "ShareDelivery",
    "SurvivorSet",
    "SurvivorSignature",
    "Transcript",
    "UnmaskRequest",
    "UnmaskShares",
    "default_num_shares",
    "ring_graph",
    "run_round",
]
