"""SecAgg+'s consistency check over the network (issue 55): a server given the roster and
clients given their identity keys (``make_dev_pki`` writes both) sign and check, a round
sums exactly, a client with an identity refuses a server that skips the check, and a server
that lies about who dropped gets no share at all: the honest clients refuse first."""

from __future__ import annotations

import numpy as np
import pytest
from test_secagg_network import modular_total, parts, pki, secure_run, secure_task  # noqa: F401

from fedax.runtime.rounds import RoundFailed
from fedax.runtime.secagg import SecAggServer
from fedax.runtime.secure_client import SecAggFault


@pytest.mark.serial
def test_a_checked_round_sums_exactly_with_a_drop_out_before_signing(pki, parts):  # noqa: F811
    task = secure_task()  # seven selected: k = 7, t = 4, signers 4
    faults = {6: SecAggFault("masked_input")}  # its y is summed, it never signs
    server, clients = secure_run(task, pki, parts, faults, checked="both", min_reports=4)
    (transcript,) = server.secure.transcripts
    p = transcript.protocol.params
    assert (p.signers, transcript.protocol.roster is not None) == (4, True)
    assert sorted(transcript.received["sign"]) == list(range(6))
    assert set(transcript.received["sign"].values()) == {"SurvivorSignature"}
    np.testing.assert_array_equal(transcript.protocol.result, modular_total(clients, range(7)))
    (record,) = server.history
    assert record["secure_bytes_in_sign"] > 0 and record["secure_survivors"] == 7
    assert all(accepted for k in range(6) for (_, _, accepted, _) in clients[k].rounds)


@pytest.mark.serial
def test_a_client_with_an_identity_refuses_a_server_that_skips_the_check(pki, parts):  # noqa: F811
    task = secure_task()
    server, clients = secure_run(task, pki, parts, checked="clients", expect_error=RoundFailed,
                                 max_attempts=1, deadline_s=2.0)
    for k in range(7):
        ((_, _, accepted, why),) = clients[k].rounds
        assert not accepted and "takes part only in rounds that check" in why
    assert server.history == [] and server.secure.transcripts[0].protocol.result is None


@pytest.mark.serial
def test_a_server_that_lies_about_who_dropped_gets_no_share_over_the_network(
        pki, parts, monkeypatch):  # noqa: F811
    """Issue 55's High finding, on loopback: the server tells every client g that the
    target survived and that the target's neighbours dropped (all but g itself), with the
    signatures of those told the same story, and asks for the shares that would rebuild
    the target's input. Each of the target's neighbours was told a story nobody else was
    (it survived), so it holds one signature, fewer than signers 4, and refuses; no client
    sends a single share, and the attempt aborts with masked vectors only."""
    target, told = 0, {}

    def stories(self):
        everyone, nbrs = set(self._u3), self.neighbours[target]
        told.update({g: (tuple(sorted(everyone)), tuple(sorted((everyone - nbrs) | {g})))
                     for g in everyone})
        return dict(told)

    def forward(self, replies):
        self._enter("sign", "unmask")
        nbrs, asks = self.neighbours[target], {}
        for g in told:
            holds = self.neighbours[g] | {g}
            same = {h: s for h, s in replies.items() if told[h] == told[g]}
            asks[g] = (tuple(sorted({g, target} & holds)),
                       tuple(sorted((nbrs - {g}) & holds)), same)
        self._requests = {g: q[:2] for g, q in asks.items()}
        return asks

    monkeypatch.setattr(SecAggServer, "sign_requests", stories)
    monkeypatch.setattr(SecAggServer, "collect_signatures", forward)
    task = secure_task()
    server, clients = secure_run(task, pki, parts, checked="both", expect_error=RoundFailed,
                                 max_attempts=1, deadline_s=2.0)
    (transcript,) = server.secure.transcripts
    assert sorted(transcript.received["sign"]) == list(range(7))  # each signed its story
    assert transcript.received["unmask"] == {}  # and then nobody revealed anything
    assert transcript.protocol.result is None and "fewer than 4 shares" in transcript.aborted
    for k in range(7):
        ((_, _, accepted, why),) = clients[k].rounds
        assert not accepted and "valid signatures" in why, why
