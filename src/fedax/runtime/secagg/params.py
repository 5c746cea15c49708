"""The public parameters of one SecAgg+ round, fixed by the server and sent to every client."""

from __future__ import annotations

from dataclasses import dataclass

from fedax.runtime.secagg.graph import check_num_shares


def _int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class SecAggParams:
    """Parameters of a SecAgg+ round (Bell et al., CCS 2020).

    Args:
        num_clients: n, the clients sampled for the round.
        num_shares: k, the holders of each client's shares (itself and its k - 1
            neighbours); odd, or n for the complete graph of Bonawitz et al. (CCS 2017).
        threshold: t, the shares that recover a secret; 2 <= t <= k. With t > k/2 even a
            server that lies about who dropped cannot collect t shares of both secrets of
            a node from clients that each reveal only one (Bell et al.); smaller t relies
            on an honest-but-curious server.
        bits: b, the sum is taken mod 2^b; inputs are in [0, 2^b). 1 <= b <= 32.
        length: d, the length of every input vector.
        session: a public id unique to the round (salt of every key derivation, bound
            into every encrypted share), 1 to 1024 bytes.
        signers: s, the consistency check (``identity``): a client reveals shares only
            with s signatures of survivors on the survivor sets it signed; 0 for none (an
            honest-but-curious server), else a strict majority of n, n/2 < s <= n
            (against a server colluding with c clients: s > (n + c) / 2).
    """

    num_clients: int
    num_shares: int
    threshold: int
    bits: int
    length: int
    session: bytes
    signers: int = 0

    def __post_init__(self):
        n, k, t = (_int(f, getattr(self, f)) for f in ("num_clients", "num_shares", "threshold"))
        bits, length = _int("bits", self.bits), _int("length", self.length)
        if n < 2:
            raise ValueError(f"num_clients {n} must be at least 2: secure aggregation of one "
                             "client reveals its input")
        check_num_shares(k, n)
        if not 2 <= t <= k:
            raise ValueError(f"threshold {t} must be in [2, num_shares {k}]")
        if not 1 <= bits <= 32:
            raise ValueError(f"bits {bits} must be in [1, 32]")
        if not 1 <= length < 2**32:
            raise ValueError(f"length {length} must be in [1, 2**32)")
        signers = _int("signers", self.signers)
        if signers and not n < 2 * signers <= 2 * n:
            raise ValueError(f"signers {signers} must be 0 or a strict majority of "
                             f"num_clients {n}: in ({n // 2}, {n}]")
        if not isinstance(self.session, bytes) or not 1 <= len(self.session) <= 1024:
            raise ValueError("session must be 1 to 1024 bytes, e.g. os.urandom(16)")

    @property
    def modulus(self) -> int:
        """2^bits."""
        return 1 << self.bits
