"""SecAgg+ against a server that lies (issue 55): identity keys, signed key advertisements
and the survivor-set consistency check (``fedax.runtime.secagg.identity``).

The attack is run for real: without the check it recovers one client's input exactly (so
the test can tell), with it the honest clients refuse and the server holds too few shares
to rebuild anything."""

from __future__ import annotations

import numpy as np
import pytest

from fedax.runtime.secagg import (
    IdentityKey,
    Roster,
    SecAggAbort,
    SecAggClient,
    SecAggError,
    SecAggParams,
    SecAggServer,
    crypto,
    ring_graph,
    run_round,
)
from fedax.runtime.secagg.protocol import _mask_seed
from fedax.runtime.secagg.shamir import combine

BITS, D = 16, 40


def _identities(n):
    return {u: IdentityKey.from_seed(b"identity %d" % u) for u in range(n)}


def _through_stage3(n, k, t, signers, seed=b"lying"):
    """Stages 1-3 run honestly (the attack comes after): server, clients, inputs, y's."""
    params = SecAggParams(n, k, t, BITS, D, b"session " + seed, signers)
    graph = ring_graph(list(range(n)), k, seed)
    ids = _identities(n) if signers else {}
    roster = Roster.of(ids) if signers else None
    server = SecAggServer(params, graph, roster)
    setups = server.setup_messages()
    clients = {u: SecAggClient.from_setup(setups[u], crypto.seeded_rng(seed + bytes([u])),
                                          ids.get(u), roster) for u in range(n)}
    keys = {u: c.setup() for u, c in clients.items()}
    dirs = server.collect_public_keys(keys, {u: c.key_signature for u, c in clients.items()})
    sent = {u: clients[u].share_keys(dirs[u], server.key_signatures) for u in dirs}
    deliveries = server.collect_shares(sent)
    rng = np.random.default_rng(0)
    inputs = {u: rng.integers(0, 2**BITS, D).astype(np.uint32) for u in range(n)}
    masked = {u: clients[u].masked_input(inputs[u], deliveries[u]) for u in deliveries}
    server.collect_masked(masked)
    return server, clients, inputs, masked


def _lie(server, clients, target):
    """Issue 55's attack: each client g is told that ``target`` survived and that the
    target's neighbours dropped (all but g itself, which knows it sent its y), with the
    signatures of the clients told the same story."""
    everyone, nbrs = set(clients), server.neighbours[target]
    stories = {g: (tuple(sorted(everyone)), tuple(sorted((everyone - nbrs) | {g})))
               for g in everyone}
    signed = {}
    if server.params.signers:
        for g, (u2, u3) in stories.items():
            try:
                signed[g] = clients[g].sign_survivors(u2, u3)
            except SecAggError:
                pass
    revealed, refused = {}, {}
    for g in sorted(everyone):
        holds = server.neighbours[g] | {g}
        survivors = sorted({g, target} & holds)
        dropped = sorted((nbrs - {g}) & holds)
        same = {h: s for h, s in signed.items() if stories[h] == stories[g]}
        try:
            revealed[g] = clients[g].unmask(survivors, dropped, same)
        except SecAggError as err:
            refused[g] = str(err)
    return revealed, refused


def _recover(server, masked, revealed, target):
    """The target's input from its y and the shares the liar collected (None: too few)."""
    p, nbrs = server.params, server.neighbours[target]
    b = [r[target] for r in revealed.values() if target in r]
    sk = {w: [r[w] for g, r in revealed.items() if w in r and g != w] for w in nbrs}
    if len(b) < p.threshold or any(len(s) < p.threshold for s in sk.values()):
        return None
    y = masked[target] - crypto.prg(combine(b), p.length, p.bits, crypto.SELF_MASK)
    for w, shares in sk.items():
        seed = _mask_seed(combine(shares), server._keys[target][0], p)
        mask = crypto.prg(seed, p.length, p.bits, crypto.PAIR_MASK)
        y = y - mask if w < target else y + mask
    return y & np.uint32(p.modulus - 1)


@pytest.mark.parametrize("n,k,t", [(20, 9, 6), (7, 7, 4)])
def test_a_server_that_lies_about_who_dropped_learns_nothing_with_the_check(n, k, t):
    target = 3
    server, clients, inputs, masked = _through_stage3(n, k, t, signers=0)
    revealed, refused = _lie(server, clients, target)
    assert not refused  # without the check every client answers its own story...
    np.testing.assert_array_equal(_recover(server, masked, revealed, target), inputs[target])

    server, clients, inputs, masked = _through_stage3(n, k, t, signers=n // 2 + 1)
    revealed, refused = _lie(server, clients, target)
    assert server.neighbours[target] <= set(refused)  # ...with it, they refuse first
    assert all("valid signatures" in why for why in refused.values())
    assert _recover(server, masked, revealed, target) is None
    b_shares = sum(target in r for r in revealed.values())
    assert b_shares < t  # not even the self-mask seed, whatever the liar combines


def test_a_server_cannot_substitute_its_own_keys():
    n, k = 9, 5
    params = SecAggParams(n, k, 3, BITS, D, b"keys", signers=5)
    graph = ring_graph(list(range(n)), k, b"keys")
    ids = _identities(n)
    server = SecAggServer(params, graph, Roster.of(ids))
    setups = server.setup_messages()
    clients = {u: SecAggClient.from_setup(setups[u], identity=ids[u], roster=Roster.of(ids))
               for u in range(n)}
    keys = {u: c.setup() for u, c in clients.items()}
    dirs = server.collect_public_keys(keys, {u: c.key_signature for u, c in clients.items()})
    victim, neighbour = 0, sorted(graph[0])[0]
    _, mine = crypto.keypair(crypto.seeded_rng(b"server"))
    forged = {**dirs[victim], neighbour: (dirs[victim][neighbour][0], mine)}
    with pytest.raises(SecAggError, match=f"client {neighbour}'s keys are not signed"):
        clients[victim].share_keys(forged, server.key_signatures)
    # a client's keys signed by another client's identity key are refused by the server
    other = SecAggServer(params, graph, Roster.of(ids))
    sigs = {u: c.key_signature for u, c in clients.items()}
    sigs[1] = sigs[2]
    other.collect_public_keys(keys, sigs)
    assert other.rejected == {1: "public keys not signed by its identity key"}


def test_a_client_signs_only_what_it_saw_and_counts_only_survivors_signatures():
    n, k, t = 9, 5, 3
    server, clients, _, _ = _through_stage3(n, k, t, signers=5, seed=b"views")
    everyone = tuple(range(n))
    u, w = 0, sorted(server.neighbours[0])[0]
    with pytest.raises(SecAggError, match="U2 lists neighbours"):  # w's shares did reach u
        clients[u].sign_survivors([v for v in everyone if v != w], [v for v in everyone
                                                                    if v != w])
    with pytest.raises(SecAggError, match="in U3"):
        clients[u].sign_survivors(everyone, everyone[1:])
    u2, u3 = server.survivor_set()
    sigs = {v: clients[v].sign_survivors(u2, u3) for v in everyone}
    with pytest.raises(SecAggError, match="asked while at unmask"):  # one statement a round
        clients[u].sign_survivors(u2, u3[:-1])
    requests = server.collect_signatures(sigs)
    survivors, dropped, _ = requests[u]
    few = {v: sigs[v] for v in everyone[:4]}  # 4 < signers 5
    with pytest.raises(SecAggError, match="4 valid signatures"):
        clients[u].unmask(survivors, dropped, few)
    forged = {**few, 4: sigs[4][:-1] + bytes([sigs[4][-1] ^ 1])}
    with pytest.raises(SecAggError, match="4 valid signatures"):
        clients[u].unmask(survivors, dropped, forged)
    assert clients[u].unmask(survivors, dropped, sigs)  # with 9 it answers


def test_a_client_with_an_identity_refuses_a_round_without_the_check():
    params = SecAggParams(5, 5, 3, BITS, D, b"no check")
    ids = _identities(5)
    with pytest.raises(SecAggError, match="takes part only in rounds that check"):
        SecAggClient(0, params, (1, 2, 3, 4), identity=ids[0], roster=Roster.of(ids))
    with pytest.raises(ValueError, match="strict majority"):
        SecAggParams(10, 5, 3, BITS, D, b"x", signers=5)
    with pytest.raises(ValueError, match="needs the roster"):
        SecAggServer(SecAggParams(5, 5, 3, BITS, D, b"x", signers=3),
                     ring_graph(list(range(5)), 5, b"g"))


@pytest.mark.parametrize("stage", ["masked_input", "sign", "unmask"])
def test_the_checked_round_sums_exactly_with_drop_outs(stage):
    n = 16
    rng = np.random.default_rng(1)
    inputs = {u: rng.integers(0, 2**BITS, D).astype(np.uint32) for u in range(n)}
    params = SecAggParams(n, 9, 6, BITS, D, b"drops", signers=9)
    drop = {"share_keys": {5}, stage: {1, 2}}
    total, log = run_round(inputs, params, drop=drop, seed=3, identities=_identities(n))
    expected = sum(inputs[u].astype(np.int64) for u in log.survivors) % 2**BITS
    np.testing.assert_array_equal(total, expected)
    assert 5 not in log.survivors and {1, 2} <= set(log.survivors)  # y sent: summed
    assert len(log.bytes_per_client("up")["sign"]) == n - 1 - 2 * (stage == "masked_input")


def test_too_few_signers_abort_before_anything_is_unmasked():
    n = 10
    inputs = {u: np.zeros(D, np.uint32) for u in range(n)}
    params = SecAggParams(n, 5, 3, BITS, D, b"few", signers=8)
    with pytest.raises(SecAggAbort, match="7 survivors signed"):
        run_round(inputs, params, drop={"masked_input": {0, 1, 2}}, seed=4,
                  identities=_identities(n))


def test_fedax_identity_makes_a_private_key_and_prints_its_roster_entry(tmp_path, capsys):
    import json
    import stat

    from fedax.cli.main import main

    path = tmp_path / "3.key"
    assert main(["identity", str(path), "--id", "3"]) == 0
    line = capsys.readouterr().out.strip()
    roster = Roster({int(c): bytes.fromhex(k) for c, k in json.loads("{" + line + "}").items()})
    key = IdentityKey.load(path)
    assert roster.keys == {3: key.public} and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert roster.verify(3, b"m", key.sign(b"m")) and not roster.verify(3, b"n", key.sign(b"m"))
    assert main(["identity", str(path), "--id", "3"]) == 2  # never overwritten
    assert "is never overwritten" in capsys.readouterr().err
    roster.save(tmp_path / "roster.json")
    assert Roster.load(tmp_path / "roster.json").keys == roster.keys
    (tmp_path / "bad.json").write_text('{"ed25519": {"0": "abc"}}')
    with pytest.raises(ValueError, match="bad.json: expected JSON"):
        Roster.load(tmp_path / "bad.json")
