"""AccessControl: allowlist/banlist files (reloaded on change), token buckets, quotas, strikes, bans.

A fake clock (a small named class) stands in for time; the access control itself is real.
"""

from __future__ import annotations

import os

import pytest

from asyncrl.coordinator.trust.access import AccessControl, AccessPolicy, parse_key_file
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import Identity
from asyncrl.swarm.rate import TokenBucket

ALICE = Identity.from_seed(bytes(range(32)))
BOB = Identity.from_seed(bytes(range(1, 33)))
MALLORY = Identity.from_seed(bytes(range(2, 34)))


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def code_of(fn, *a, **kw) -> RejectCode:
    with pytest.raises(ProtocolError) as e:
        fn(*a, **kw)
    return e.value.code


def make(clock=None, **policy) -> AccessControl:
    clock = clock or FakeClock()
    return AccessControl(AccessPolicy(**policy), clock=clock, wall=clock)


def test_token_bucket_refills_at_its_rate():
    b = TokenBucket(rate=2.0, burst=3, now=0.0)
    assert [b.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert b.take(0.5) and not b.take(0.5)  # one token per half second
    assert TokenBucket(rate=0, burst=1, now=0).take(0.0)  # rate 0 = unlimited


def test_key_file_accepts_hex_peer_id_and_fingerprint():
    text = f"# volunteers\n{ALICE.public_key.hex()}\n{BOB.peer_id}  # bob\n{MALLORY.fingerprint}\n\n"
    keys, fps = parse_key_file(text)
    assert keys == {ALICE.public_key, BOB.public_key} and fps == {MALLORY.fingerprint}
    with pytest.raises(ValueError):
        parse_key_file("not-a-key\n")


def test_allowlist_is_reloaded_without_restart(tmp_path):
    allow = tmp_path / "allow.txt"
    allow.write_text(ALICE.public_key.hex() + "\n")
    ac = make(mode="allowlist", allowlist_path=str(allow))
    ac.check_signer(ALICE.public_key)
    assert code_of(ac.check_signer, BOB.public_key) is RejectCode.NOT_ALLOWED
    allow.write_text(ALICE.public_key.hex() + "\n" + BOB.fingerprint + "\n")
    os.utime(allow, ns=(1, 1))  # a different mtime even on coarse-timestamp filesystems
    ac.check_signer(BOB.public_key)
    allow.write_text("garbage line\n")  # a broken edit keeps the previous list (never opens the gate)
    os.utime(allow, ns=(2, 2))
    ac.check_signer(BOB.public_key)
    assert code_of(ac.check_signer, MALLORY.public_key) is RejectCode.NOT_ALLOWED
    assert ac.status()["allowlist_error"]


def test_missing_allowlist_fails_closed(tmp_path):
    ac = make(mode="allowlist", allowlist_path=str(tmp_path / "nope.txt"))
    assert code_of(ac.check_signer, ALICE.public_key) is RejectCode.NOT_ALLOWED


def test_banlist_file_refuses_in_open_mode(tmp_path):
    ban = tmp_path / "ban.txt"
    ban.write_text(MALLORY.peer_id + "\n")
    ac = make(banlist_path=str(ban))
    ac.check_signer(ALICE.public_key)
    assert code_of(ac.check_signer, MALLORY.public_key) is RejectCode.NOT_ALLOWED


def test_identity_rate_limit_and_new_identity_brake():
    clock = FakeClock()
    ac = make(clock, identity_rate_per_s=1.0, identity_burst=2, new_identity_rate_per_s=1.0, new_identity_burst=2)
    ac.admit_identity(ALICE.public_key)
    ac.admit_identity(ALICE.public_key)
    assert code_of(ac.admit_identity, ALICE.public_key) is RejectCode.RATE_LIMITED
    clock.t += 1.0
    ac.admit_identity(ALICE.public_key)
    # Sybil: fresh keys draw on one shared first-contact bucket (alice was one of its 2 tokens)
    sybils = [Identity.generate().public_key for _ in range(5)]
    codes = []
    for key in sybils:
        try:
            ac.admit_identity(key)
            codes.append(None)
        except ProtocolError as exc:
            codes.append(exc.code)
    assert codes.count(None) == 2 and codes.count(RejectCode.RATE_LIMITED) == 3  # 1 left + 1 refilled
    assert ac.status()["counters"]["new_identity_limited"] == 3


def test_peer_rate_limit_and_peer_ban():
    ac = make(peer_rate_per_s=0.001, peer_burst=2, peer_max_strikes=2)
    ac.admit_peer("peerA")
    ac.admit_peer("peerA")
    assert code_of(ac.admit_peer, "peerA") is RejectCode.RATE_LIMITED
    ac.admit_peer("peerB")
    assert not ac.on_reject(RejectCode.SIGNATURE_MISMATCH, signer=None, peer="peerB")
    assert ac.on_reject(RejectCode.MALFORMED, signer=None, peer="peerB")  # second strike bans
    assert code_of(ac.admit_peer, "peerB") is RejectCode.NOT_ALLOWED


def test_hourly_quota():
    clock = FakeClock()
    ac = make(clock, batches_per_hour=2)
    for _ in range(2):
        ac.admit_identity(ALICE.public_key)
        ac.record_accepted(ALICE.public_key)
    assert code_of(ac.admit_identity, ALICE.public_key) is RejectCode.RATE_LIMITED
    clock.t += 3601
    ac.admit_identity(ALICE.public_key)


def test_strikes_only_for_lies_and_ban_after_max():
    ac = make(max_strikes=2)
    for code in (RejectCode.NONCE_REUSED, RejectCode.EXPIRED, RejectCode.WRONG_AUDIENCE, RejectCode.DUPLICATE_BATCH,
                 RejectCode.UNKNOWN_LEASE, RejectCode.STALE_VERSION, RejectCode.RATE_LIMITED, RejectCode.UNSCORABLE,
                 RejectCode.DEADLINE_EXCEEDED):
        assert not ac.on_reject(code, signer=ALICE.public_key)  # anyone (or we) can cause these: never strike
    ac.record_accepted(ALICE.public_key)
    assert not ac.on_reject(RejectCode.REWARD_MISMATCH, signer=ALICE.public_key)  # recomputed anyway: no strike...
    assert ac.strikes(ALICE.public_key) == 0 and ac.valid_streak(ALICE.public_key) == 0  # ...but audited again
    ac.record_accepted(MALLORY.public_key)
    assert ac.valid_streak(MALLORY.public_key) == 1
    assert not ac.on_reject(RejectCode.MALFORMED, signer=MALLORY.public_key)
    assert ac.valid_streak(MALLORY.public_key) == 0  # a strike resets the track record
    assert ac.on_reject(RejectCode.LOGPROB_MISMATCH, signer=MALLORY.public_key)
    assert code_of(ac.check_signer, MALLORY.public_key) is RejectCode.NOT_ALLOWED
    ac.check_signer(ALICE.public_key)


def test_bans_and_strikes_survive_a_restart():
    ac = make(max_strikes=1)
    ac.on_reject(RejectCode.MALFORMED, signer=MALLORY.public_key)
    for _ in range(3):
        ac.on_reject(RejectCode.SIGNATURE_MISMATCH, signer=None, peer="evil")
    fresh = make(max_strikes=1, peer_max_strikes=3)
    fresh.load_state(ac.state_bytes())
    assert fresh.is_banned(MALLORY.public_key)
    with pytest.raises(ProtocolError) as e:
        fresh.load_state(b"\x00garbage")
    assert e.value.code is RejectCode.MALFORMED


def test_a_key_on_the_operators_banlist_is_not_proven_from_the_start(tmp_path):
    """At a resume the coordinator weighs retirements (TaskBoard.recheck_retired) before any request has made it
    read the banlist: a reporter the operator banned meanwhile must not count as proven then."""
    ac = make()
    ac.record_accepted(ALICE.public_key, ALICE.peer_id)
    ac.record_accepted(BOB.public_key, BOB.peer_id)
    banlist = tmp_path / "banlist.txt"
    banlist.write_text(f"{ALICE.peer_id}  # colluded in poison reports\n")
    fresh = make(banlist_path=str(banlist))
    fresh.load_state(ac.state_bytes())
    assert not fresh.has_accepted(ALICE.public_key) and fresh.has_accepted(BOB.public_key)


def test_track_records_survive_a_restart():
    """Who is proven, and who delivers from its own peer, outlive a restart: after it, a copy of alice's request
    from another peer is still refused, and her reports still weigh as a proven key's."""
    ac = make()
    ac.record_accepted(ALICE.public_key, ALICE.peer_id)
    ac.record_accepted(ALICE.public_key, ALICE.peer_id)
    fresh = make()
    fresh.load_state(ac.state_bytes())
    assert fresh.has_accepted(ALICE.public_key) and fresh.valid_streak(ALICE.public_key) == 2
    assert not fresh.has_accepted(BOB.public_key)
    assert code_of(fresh.admit_identity, ALICE.public_key, peer="copier") is RejectCode.NOT_ALLOWED
