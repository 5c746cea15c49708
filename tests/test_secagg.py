"""SecAgg+ (fedax.runtime.secagg): Shamir algebra, the cryptography, the graph, exact sums
under drop-outs up to the threshold, aborts below it, the uniformity of masked vectors, a
server that asks for both shares of a node, and strict parsing of every message."""

import dataclasses
import itertools
import random

import numpy as np
import pytest
from scipy import stats

from fedax.runtime.secagg import (
    EncryptedShares,
    KeyDirectory,
    MaskedVector,
    PublicKeys,
    SecAggAbort,
    SecAggClient,
    SecAggError,
    SecAggParams,
    SecAggServer,
    Setup,
    ShareBundle,
    ShareDelivery,
    SurvivorSet,
    SurvivorSignature,
    UnmaskRequest,
    UnmaskShares,
    crypto,
    default_num_shares,
    messages,
    ring_graph,
    run_round,
    shamir,
)

# ------------------------------------------------------------------------- helpers


def _inputs(ids, d, bits, seed=0):
    rng = np.random.default_rng(seed)
    return {i: rng.integers(0, 2**bits, d, dtype=np.uint64) for i in ids}


def _expected(inputs, survivors, bits):
    total = sum(inputs[u].astype(np.uint64) for u in survivors)
    return (total % 2**bits).astype(np.uint32)


def _params(n=10, k=None, t=None, bits=16, d=200):
    k = k or default_num_shares(n)
    return SecAggParams(n, k, t or k // 2 + 1, bits, d, b"test session")


def _through_stage2(params, seed):
    """Stages 1-2 driven directly: the server, clients and each client's sent shares."""
    ids = list(range(params.num_clients))
    graph = ring_graph(ids, params.num_shares, seed)
    server = SecAggServer(params, graph)
    clients = {u: SecAggClient(u, params, graph[u], crypto.seeded_rng(seed + bytes([u])))
               for u in ids}
    dirs = server.collect_public_keys({u: c.setup() for u, c in clients.items()})
    return server, clients, {u: clients[u].share_keys(dirs[u]) for u in dirs}


def _through_stage3(params, seed=b"direct", masked_drop=()):
    """Stages 1-3 driven directly (no bytes): the server, clients and unmask requests."""
    ids = list(range(params.num_clients))
    server, clients, sent = _through_stage2(params, seed)
    deliveries = server.collect_shares(sent)
    inputs = _inputs(ids, params.length, params.bits)
    masked = {u: clients[u].masked_input(inputs[u], deliveries[u]) for u in deliveries
              if u not in masked_drop}
    return server, clients, server.collect_masked(masked), inputs


# ------------------------------------------------------------------------- Shamir


def test_shamir_any_t_shares_recover():
    rng = random.Random(1)
    for length in (1, 15, 16, 31, 32, 33):
        secret = rng.randbytes(length)
        points = [3, 8, 9, 20, 41, 42, 100]
        shares = shamir.split(secret, points, 4, rng=rng.randbytes)
        for r in range(4, 8):
            for subset in itertools.combinations(shares, r):
                assert shamir.combine(subset) == secret


def test_shamir_refuses_below_threshold_and_corruption():
    shares = shamir.split(b"s" * 32, [1, 2, 3, 4, 5], 3)
    with pytest.raises(SecAggError, match="fewer than the threshold"):
        shamir.combine(shares[:2])
    bad = bytearray(shares[4])
    bad[-1] ^= 1
    with pytest.raises(SecAggError, match="disagree"):
        shamir.combine(shares[:4] + [bytes(bad)])
    with pytest.raises(SecAggError, match="same point"):
        shamir.combine([shares[0], shares[0], shares[1]])
    with pytest.raises(SecAggError, match="malformed"):
        shamir.combine([shares[0][:-1], shares[1], shares[2]])


def _feed(*values):
    """An rng that returns the given field elements (2 bytes each, GF(257)) in order."""
    it = iter(v.to_bytes(2, "big") for v in values)
    return lambda n: next(it)


def test_shamir_one_share_is_uniform_whatever_the_secret():
    """t = 2: over all 257 choices of the random coefficient, one share takes every field
    value exactly once, for every secret: it carries no information."""
    for secret in (0, 1, 128, 255):
        values = sorted(shamir.parse(shamir.split(bytes([secret]), [5, 9], 2, rng=_feed(a),
                                                  prime=257)[0], prime=257)[3][0]
                        for a in range(257))
        assert values == list(range(257))


def test_shamir_t_minus_1_shares_fit_every_secret():
    """t = 3: two shares of one secret are exactly what split would have produced for every
    other secret, under exactly one draw of the random coefficients."""
    p, (x1, x2) = 257, (4, 11)
    observed = shamir.split(b"\x07", [x1, x2, 12], 3, rng=_feed(33, 190), prime=257)[:2]
    y1, y2 = (shamir.parse(s, prime=p)[3][0] for s in observed)
    for s in range(256):
        draws = [(a1, (y1 - s - a1 * x1) * pow(x1 * x1, -1, p) % p) for a1 in range(p)]
        draws = [(a1, a2) for a1, a2 in draws if (s + a1 * x2 + a2 * x2 * x2) % p == y2]
        assert len(draws) == 1
        again = shamir.split(bytes([s]), [x1, x2, 12], 3, rng=_feed(*draws[0]), prime=p)[:2]
        assert again[0][8:] == observed[0][8:] and again[1][8:] == observed[1][8:]


# ------------------------------------------------------------------------- crypto


def test_key_agreement_is_symmetric_and_domain_separated():
    sk_a, pk_a = crypto.keypair()
    sk_b, pk_b = crypto.keypair()
    assert crypto.public_key(sk_a) == pk_a
    k_ab = crypto.agree(sk_a, pk_b, info=crypto.MASK_INFO, salt=b"s")
    assert k_ab == crypto.agree(sk_b, pk_a, info=crypto.MASK_INFO, salt=b"s")
    assert k_ab != crypto.agree(sk_a, pk_b, info=crypto.SHARE_INFO, salt=b"s")
    assert k_ab != crypto.agree(sk_a, pk_b, info=crypto.MASK_INFO, salt=b"t")
    with pytest.raises(SecAggError, match="key agreement"):  # a low-order point
        crypto.agree(sk_a, bytes(32), info=crypto.MASK_INFO, salt=b"s")


def test_aead_refuses_tampering_and_misrouting():
    key = crypto.agree(crypto.keypair()[0], crypto.keypair()[1], info=b"x", salt=b"s")
    box = crypto.seal(key, b"share bytes", session=b"s", src=1, dst=2)
    assert crypto.unseal(key, box, session=b"s", src=1, dst=2) == b"share bytes"
    for i in range(len(box)):
        flipped = bytearray(box)
        flipped[i] ^= 0x40
        with pytest.raises(SecAggError, match="authentication"):
            crypto.unseal(key, bytes(flipped), session=b"s", src=1, dst=2)
    for session, src, dst in ((b"t", 1, 2), (b"s", 2, 1), (b"s", 1, 3)):
        with pytest.raises(SecAggError, match="authentication"):
            crypto.unseal(key, box, session=session, src=src, dst=dst)
    with pytest.raises(SecAggError, match="too short"):
        crypto.unseal(key, box[:20], session=b"s", src=1, dst=2)


def test_prg_is_chacha20_deterministic_and_distinct():
    # RFC 8439 A.1, test vector 1: all-zero key and nonce, block counter 0.
    assert crypto.prg(bytes(32), 2, 32, b"")[0] == int.from_bytes(bytes.fromhex("76b8e0ad"),
                                                                   "little")
    seed = bytes(range(32))
    a = crypto.prg(seed, 1000, 32, crypto.PAIR_MASK)
    assert a.dtype == np.uint32 and a.shape == (1000,)
    np.testing.assert_array_equal(a, crypto.prg(seed, 1000, 32, crypto.PAIR_MASK))
    assert (a != crypto.prg(bytes(31) + b"\1", 1000, 32, crypto.PAIR_MASK)).mean() > 0.99
    assert (a != crypto.prg(seed, 1000, 32, crypto.SELF_MASK)).mean() > 0.99
    np.testing.assert_array_equal(crypto.prg(seed, 1000, 5, crypto.PAIR_MASK), a & 31)
    np.testing.assert_array_equal(crypto.prg(seed, 10, 32, crypto.PAIR_MASK), a[:10])


# ------------------------------------------------------------------------- graph and params


@pytest.mark.parametrize("n,k", [(5, 3), (5, 5), (10, 7), (10, 9), (10, 10), (17, 9), (50, 13)])
def test_ring_graph_is_k_regular_and_symmetric(n, k):
    ids = [3 * i + 7 for i in range(n)]
    graph = ring_graph(ids, k, b"seed")
    assert sorted(graph) == ids
    for u, nbrs in graph.items():
        assert len(nbrs) == len(set(nbrs)) == k - 1 and u not in nbrs
        assert all(u in graph[v] for v in nbrs)
    if k == n:
        assert all(set(nbrs) | {u} == set(ids) for u, nbrs in graph.items())
    assert graph == ring_graph(reversed(ids), k, b"seed")
    if k < n - 1:
        assert graph != ring_graph(ids, k, b"another seed")


def test_graph_and_params_validation():
    assert [default_num_shares(n) for n in (2, 5, 10, 50, 100, 1000)] == [2, 5, 9, 13, 15, 21]
    with pytest.raises(ValueError, match=r"must be odd \(use 5\)"):
        ring_graph(range(10), 4, b"s")
    for args, match in [((10, 4, 3, 16, 8, b"s"), "odd"), ((10, 5, 6, 16, 8, b"s"), "threshold"),
                        ((10, 5, 1, 16, 8, b"s"), "threshold"), ((10, 5, 3, 33, 8, b"s"), "bits"),
                        ((10, 5, 3, 0, 8, b"s"), "bits"), ((10, 11, 3, 16, 8, b"s"), "num_shares"),
                        ((10, 5, 3, 16, 0, b"s"), "length"), ((10, 5, 3, 16, 8, b""), "session"),
                        ((1, 1, 1, 16, 8, b"s"), "at least 2"), ((10, 5.0, 3, 16, 8, b"s"), "int")]:
        with pytest.raises(ValueError, match=match):
            SecAggParams(*args)


# ------------------------------------------------------------------------- exact sums


def test_sum_without_dropouts():
    params = _params(n=10, bits=16)
    inputs = _inputs(range(10), params.length, 16)
    total, log = run_round(inputs, params, seed=1)
    assert log.survivors == tuple(range(10)) and total.dtype == np.uint32
    np.testing.assert_array_equal(total, _expected(inputs, range(10), 16))
    masked = [MaskedVector.from_bytes(b).values for s, _, b in log.received if s == "masked_input"]
    assert len(masked) == 10 and all((m != inputs[u]).mean() > 0.99 for u, m in enumerate(masked))
    assert (sum(m.astype(np.uint64) for m in masked) % 2**16 != total).mean() > 0.99  # self-masks


def _closed(graph, u):
    return {u, *graph[u]}


def _threshold_case(seed):
    """n = 20, k = 7, t = 4, ids 0, 2, .., 38; the graph of ``seed`` and a target node."""
    params = _params(n=20, k=7, t=4, bits=12, d=300)
    ids = list(range(0, 40, 2))
    inputs = _inputs(ids, params.length, 12, seed=seed)
    graph = run_round(inputs, params, seed=seed)[1].graph  # a full round, to read its graph
    return params, ids, inputs, graph, ids[5]


@pytest.mark.parametrize("stage", ["offline", "setup", "share_keys", "masked_input", "unmask"])
def test_sum_with_dropouts_up_to_the_threshold(stage):
    """k - t = 3 of the target's share holders drop (the most it can lose), and one more
    node elsewhere; the sum of the survivors' inputs is exact."""
    params, ids, inputs, graph, target = _threshold_case(seed=3)
    dropped = set(graph[target][:3])
    for u in ids:  # one more drop that leaves every node t share holders or more
        trial = dropped | {u}
        if u not in _closed(graph, target) and all(
                len(_closed(graph, w) - trial) >= params.threshold for w in ids):
            dropped = trial
            break
    assert len(dropped) == 4 and len(_closed(graph, target) - dropped) == params.threshold
    total, log = run_round(inputs, params, drop={stage: dropped}, seed=3)
    gone = stage in ("offline", "setup", "share_keys")
    assert set(log.survivors) == (set(ids) - dropped if gone else set(ids))
    np.testing.assert_array_equal(total, _expected(inputs, log.survivors, 12))
    assert log.bytes_per_client("up")["unmask"].keys() == set(ids) - dropped
    requests = [UnmaskRequest.from_bytes(b) for s, _, b in log.sent if s == "unmask"]
    recovered_keys = set().union(*(r.dropped for r in requests))
    assert recovered_keys == (dropped if stage == "share_keys" else set())


def test_a_client_left_with_too_few_share_holders_is_left_out():
    params, ids, inputs, graph, target = _threshold_case(seed=3)
    dropped = set(graph[target][:4])  # before sharing: the target would have t - 1 holders
    total, log = run_round(inputs, params, drop={"setup": dropped}, seed=3)
    assert target not in log.survivors and set(log.survivors) == set(ids) - dropped - {target}
    np.testing.assert_array_equal(total, _expected(inputs, log.survivors, 12))


@pytest.mark.parametrize("stage,many", [("offline", True), ("setup", True), ("share_keys", True),
                                        ("share_keys", False)])
def test_below_the_threshold_the_round_aborts_holding_masked_vectors_only(stage, many):
    """n - t + 1 drop-outs, or t - 1 share holders left to a node that sent its masked
    vector: the round aborts before anyone is asked for a share."""
    params, ids, inputs, graph, target = _threshold_case(seed=5)
    dropped = set(ids[:params.num_clients - params.threshold + 1] if many else graph[target][:4])
    with pytest.raises(SecAggAbort, match="fewer than the threshold") as err:
        run_round(inputs, params, drop={stage: dropped}, seed=5)
    log = err.value.transcript
    assert log.aborted == err.value.reason
    if not many:
        assert f"client {target}'s shares" in log.aborted
    assert {s for s, _, _ in log.received} <= {"setup", "share_keys", "masked_input"}
    assert not [m for s, _, m in log.sent if s == "unmask"]


@pytest.mark.parametrize("stage", ["masked_input", "unmask"])
def test_too_few_unmask_replies_abort(stage):
    params, ids, inputs, graph, target = _threshold_case(seed=5)
    with pytest.raises(SecAggAbort, match=f"fewer than 4 shares arrived for clients .*{target}"):
        run_round(inputs, params, drop={stage: set(graph[target][:4])}, seed=5)


def test_below_the_threshold_in_unmask_the_server_reconstructs_nothing():
    params = _params(n=10, k=5, t=3, bits=16, d=100)
    server, clients, requests, _ = _through_stage3(params)
    victim = 0
    holders = [v for v, (surv, _) in requests.items() if victim in surv]
    answers = {v: clients[v].unmask(*requests[v]) for v in requests if v in holders[:2]}
    with pytest.raises(SecAggAbort, match=f"clients \\[{victim}"):
        server.collect_unmask(answers)
    assert server.result is None and server.stage == "aborted"


def test_full_length_vector_with_a_dropout():
    params = SecAggParams(6, 5, 3, 32, 199_210, b"full length")
    inputs = _inputs(range(6), params.length, 32, seed=6)
    total, log = run_round(inputs, params, drop={"share_keys": {2}}, seed=7)
    assert log.survivors == (0, 1, 3, 4, 5)
    np.testing.assert_array_equal(total, _expected(inputs, log.survivors, 32))


# ------------------------------------------------------------------------- privacy


@pytest.mark.parametrize("bits", [8, 32])
def test_masked_vectors_are_uniform_while_inputs_are_not(bits):
    """Chi-square over 256 bins (the top 8 bits mod 2^bits) at alpha = 1e-3."""
    params = _params(n=10, bits=bits, d=4096)
    inputs = {u: np.zeros(params.length, np.uint32) for u in range(10)}
    inputs[3][::2] = 2**bits - 1  # far from uniform, not only zeros
    _, log = run_round(inputs, params, drop={"share_keys": {4}}, seed=8)
    masked = np.concatenate([MaskedVector.from_bytes(b).values
                             for s, _, b in log.received if s == "masked_input"])

    def p_value(values):
        counts = np.bincount((values >> (bits - 8)).astype(np.int64), minlength=256)
        return stats.chisquare(counts).pvalue

    assert p_value(masked) > 1e-3
    assert p_value(np.concatenate(list(inputs.values()))) < 1e-3


def _garbled_round(params, rogue, garbled, seed=b"garbage"):
    """Stages 1-4 driven directly, ``rogue``'s shares for the neighbours in ``garbled``
    replaced by random bytes; (server, the unmasked sum or None if aborted, inputs)."""
    ids = list(range(params.num_clients))
    server, clients, sent = _through_stage2(params, seed)
    rng = np.random.default_rng(0)
    for v in garbled:
        sent[rogue][v] = rng.bytes(len(sent[rogue][v]))
    deliveries = server.collect_shares(sent)
    inputs = _inputs(ids, params.length, params.bits)
    masked = {u: clients[u].masked_input(inputs[u], deliveries[u]) for u in deliveries}
    blamed = {u: clients[u].blamed for u in deliveries}
    assert {u for u, b in blamed.items() if b} == set(garbled)
    assert all(b == (rogue,) for b in blamed.values() if b)
    try:
        requests = server.collect_masked(masked, blamed)
        replies = {v: clients[v].unmask(*q) for v, q in requests.items()}
        return server, server.collect_unmask(replies), inputs
    except SecAggAbort:
        return server, None, inputs


@pytest.mark.parametrize("part", ["all", "most", "few"])
def test_a_client_whose_shares_do_not_open_is_dropped_and_the_sum_is_the_others(part):
    """A client that sends garbage shares (issue 55: it made every honest neighbour drop
    out, and the round abort) is blamed by each neighbour that cannot open them and
    dropped; the sum is the honest clients' exactly. Its key is recovered from the
    neighbours that did open its shares where some survivor masked with it: with fewer
    than t of those the attempt aborts, before anything is unmasked."""
    params = _params(n=12, k=9, t=5)  # eight neighbours each
    rogue = 3
    graph = ring_graph(range(12), 9, b"garbage")
    neighbours = sorted(graph[rogue])
    garbled = {"all": neighbours, "most": neighbours[:5], "few": neighbours[:2]}[part]
    server, total, inputs = _garbled_round(params, rogue, garbled)
    honest = [u for u in range(12) if u != rogue]
    if part == "most":  # three survivors masked with it and hold shares of its key: < t
        assert total is None and "fewer than the threshold" in server.aborted
        assert server.result is None
        return
    assert server.survivors == tuple(honest)
    assert server.rejected == {rogue: f"blamed by {sorted(garbled)}: shares that do not open"}
    np.testing.assert_array_equal(total, _expected(inputs, honest, params.bits))


def test_a_blame_of_a_client_that_sent_no_shares_sets_the_reply_aside():
    params = _params(n=10, k=7, t=4)
    ids = list(range(10))
    graph = ring_graph(ids, 7, b"g")
    server = SecAggServer(params, graph)
    clients = {u: SecAggClient(u, params, graph[u]) for u in ids}
    dirs = server.collect_public_keys({u: c.setup() for u, c in clients.items()})
    deliveries = server.collect_shares({u: clients[u].share_keys(dirs[u]) for u in dirs})
    inputs = _inputs(ids, params.length, params.bits)
    masked = {u: clients[u].masked_input(inputs[u], deliveries[u]) for u in ids}
    stranger = next(v for v in ids if v != 0 and v not in graph[0])
    requests = server.collect_masked(masked, {0: (stranger,)})
    assert server.rejected == {0: "blames a client that sent it no shares"}
    assert 0 not in server.survivors
    total = server.collect_unmask({v: clients[v].unmask(*q) for v, q in requests.items()})
    np.testing.assert_array_equal(total, _expected(inputs, ids[1:], params.bits))


def test_a_client_never_reveals_both_shares_of_one_node():
    params = _params(n=10, k=5, t=3, bits=16, d=50)
    server, clients, requests, _ = _through_stage3(params, masked_drop={4})
    v = next(v for v, (_, dropped) in requests.items() if 4 in dropped)
    survivors, dropped = requests[v]
    other = next(u for u in survivors if u != v)
    with pytest.raises(SecAggError, match="survivors and as dropped"):
        clients[v].unmask(survivors, dropped + (other,))
    assert clients[v].unmask(survivors, dropped) == clients[v].unmask(survivors, dropped)
    with pytest.raises(SecAggError, match="never reveals both"):  # across two requests
        clients[v].unmask([x for x in survivors if x != other], dropped + (other,))
    with pytest.raises(SecAggError, match="never reveals both"):
        clients[v].unmask(survivors + (4,), [x for x in dropped if x != 4])
    with pytest.raises(SecAggError, match="not listed as a survivor"):
        clients[v].unmask([x for x in survivors if x != v], dropped + (v,))
    with pytest.raises(SecAggError, match="not listed as a survivor"):
        clients[v].unmask([x for x in survivors if x != v], dropped)
    stranger = next(u for u in range(10) if u not in survivors + dropped)
    with pytest.raises(SecAggError, match="holds no shares"):
        clients[v].unmask(survivors + (stranger,), dropped)


def test_client_refuses_bad_directories_inputs_and_deliveries():
    params = _params(n=5, k=5, t=3, bits=8, d=20)
    graph = ring_graph(range(5), 5, b"g")
    clients = {u: SecAggClient(u, params, graph[u]) for u in range(5)}
    keys = {u: c.setup() for u, c in clients.items()}
    with pytest.raises(SecAggError, match="equal"):
        clients[0].share_keys(keys | {1: keys[2]})
    with pytest.raises(SecAggError, match="as this client's own"):
        clients[0].share_keys(keys | {0: keys[1]})
    with pytest.raises(SecAggError, match="not a usable X25519 key"):  # a low-order point
        clients[0].share_keys(keys | {1: (bytes(32), keys[1][1])})
    with pytest.raises(SecAggError, match="fewer than the threshold"):
        clients[0].share_keys({u: keys[u] for u in (0, 1)})
    with pytest.raises(SecAggError, match="masked_input asked while at share_keys"):
        clients[0].masked_input(np.zeros(20, np.uint8), {})
    sent = {u: c.share_keys(keys) for u, c in clients.items()}
    to_0 = {u: sent[u][0] for u in range(1, 5)}
    for x, match in [(np.full(20, 256), "input values"), (np.zeros(19, int), "shape"),
                     (np.zeros(20), "integer"), (np.full(20, -1), "input values")]:
        with pytest.raises(SecAggError, match=match):
            clients[0].masked_input(x, to_0)
    with pytest.raises(SecAggError, match="authentication"):  # 1's share for 2, sent to 0
        clients[0].open_shares(1, sent[1][2])
    with pytest.raises(SecAggError, match="fewer than the threshold"):
        clients[0].masked_input(np.zeros(20, int), {1: to_0[1]})
    key = crypto.agree(clients[1]._sk2, keys[0][1], info=crypto.SHARE_INFO, salt=params.session)
    at_0, at_1 = shamir.split(bytes(32), [1, 2, 3], 3)[:2]  # points of clients 0 and 1
    for bundle, match in [(ShareBundle(3, 0, at_0, at_0), "arrived as 1's"),
                          (ShareBundle(1, 0, at_1, at_1), "not shares for this client")]:
        forged = crypto.seal(key, bundle.to_bytes(), session=params.session, src=1, dst=0)
        with pytest.raises(SecAggError, match=match):
            clients[0].open_shares(1, forged)
    with pytest.raises(SecAggError, match=r"fewer than the threshold"):  # blamed shares
        clients[0].masked_input(np.zeros(20, int), {1: forged, 2: to_0[2]})  # do not count
    # a share that does not open is blamed, not refused: the client goes on without it
    assert clients[0].masked_input(np.zeros(20, int), to_0 | {1: forged}).shape == (20,)
    assert clients[0].blamed == (1,)


def test_server_sets_aside_unusable_public_keys():
    params = _params(n=7, k=7, t=3, bits=8, d=20)
    server = SecAggServer(params, ring_graph(range(7), 7, b"g"))
    pk = [crypto.keypair()[1] for _ in range(12)]
    replies = {0: (pk[0], pk[1]), 1: (pk[2], pk[2]), 2: (bytes(32), pk[3]), 3: (pk[4], pk[0]),
               4: (pk[5], pk[6]), 5: (pk[7], pk[8]), 6: (pk[9], pk[10]), 9: (pk[11], pk[11])}
    directories = server.collect_public_keys(replies)
    assert server.rejected.keys() == {0, 1, 2, 3, 9}
    assert directories.keys() == {4, 5, 6} and directories[4].keys() == {4, 5, 6}


def test_server_sets_aside_replies_that_break_the_protocol():
    params = _params(n=5, k=5, t=3, bits=8, d=20)
    server, clients, requests, inputs = _through_stage3(params)
    good = {v: clients[v].unmask(*requests[v]) for v in requests}
    bad = dict(good[1])
    bad[0] = good[2][0]  # a share at another client's point
    total = server.collect_unmask(good | {1: bad, 9: {}})
    assert server.rejected.keys() == {1, 9}
    np.testing.assert_array_equal(total, _expected(inputs, range(5), 8))


# ------------------------------------------------------------------------- messages


def _messages():
    params = _params(n=5, k=5, t=3, bits=12, d=6)
    share = shamir.split(bytes(32), [1, 2, 3], 2)[0]
    return [Setup(params, 3, (0, 1, 2, 4)), PublicKeys(3, b"a" * 32, b"b" * 32),
            KeyDirectory({1: (b"a" * 32, b"b" * 32), 4: (b"c" * 32, b"d" * 32)}),
            EncryptedShares(3, {1: b"xyz", 4: b""}), ShareDelivery(3, {0: b"abc"}),
            MaskedVector(3, 12, np.arange(6, dtype=np.uint32) * 800, (1, 4)),
            UnmaskRequest((3, 0, 1), (4,)), UnmaskShares(3, {0: share, 4: share}),
            ShareBundle(3, 4, share, share),
            Setup(dataclasses.replace(params, signers=3), 3, (0, 1, 2, 4), (0, 1, 2, 3, 4)),
            PublicKeys(3, b"a" * 32, b"b" * 32, b"s" * 64),
            KeyDirectory({1: (b"a" * 32, b"b" * 32)}, {1: b"s" * 64}),
            SurvivorSet((0, 1, 3, 4), (0, 3)), SurvivorSignature(3, b"s" * 64),
            UnmaskRequest((3, 0), (4,), {0: b"s" * 64, 3: b"t" * 64})]


def test_messages_round_trip_and_masked_vectors_are_packed():
    for msg in _messages():
        back = type(msg).from_bytes(msg.to_bytes())
        if isinstance(msg, MaskedVector):
            np.testing.assert_array_equal(back.values, msg.values)
            assert back.blamed == msg.blamed == (1, 4)
            # 12 bits travel as uint16; then the blamed ids (count, ids)
            assert len(msg.to_bytes()) == 2 + 9 + 6 * 2 + 4 + 2 * 4
        else:
            assert back == msg


def test_malformed_messages_raise_secagg_error_only():
    rng = random.Random(9)
    for msg in _messages():
        data, cls = msg.to_bytes(), type(msg)
        for cut in range(len(data)):
            with pytest.raises(SecAggError, match="malformed"):
                cls.from_bytes(data[:cut])
        for junk in (data + b"\0", b"\x01\x63" + data[2:], "text", None, bytes(40)):
            with pytest.raises(SecAggError, match="malformed"):
                cls.from_bytes(junk)
        for _ in range(200):  # random corruption: parsed, or refused, never another error
            bad = bytearray(data)
            for _ in range(rng.randint(1, 3)):
                bad[rng.randrange(2, len(bad))] = rng.randrange(256)
            try:
                cls.from_bytes(bytes(bad))
            except SecAggError:
                pass
    huge = bytes([messages.VERSION, 7]) + b"\xff\xff\xff\xff"  # ids: 2^32 - 1 of them
    with pytest.raises(SecAggError, match="truncated"):
        UnmaskRequest.from_bytes(huge)
    over = MaskedVector(1, 12, np.array([4096], np.uint32)).to_bytes()
    with pytest.raises(SecAggError, match="below 2\\^12"):
        MaskedVector.from_bytes(over)
