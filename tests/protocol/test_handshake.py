"""The version gate and the cross-version handshake (protocol/handshake.py), the run's final pointer."""

from __future__ import annotations

import msgspec
import pytest

from asyncrl.protocol import envelope, handshake, messages, swarm
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import Identity

COORD = Identity.from_seed(bytes(range(32)))
NOW = handshake.package_version()


def refusal(**kw):
    base = dict(client_protocol=handshake.PROTOCOL_VERSION, client_schema=handshake.SCHEMA_VERSION,
                client_version="0.2.0", coordinator_version="0.2.0")
    return handshake.client_refusal(**{**base, **kw})


def test_the_gate_refuses_other_schemas_protocols_old_and_known_bad_releases():
    assert refusal() is None
    for kw in (dict(client_schema=handshake.SCHEMA_VERSION - 1), dict(client_schema=handshake.SCHEMA_VERSION + 1),
               dict(client_protocol=handshake.PROTOCOL_VERSION + 1), dict(min_client_version="0.2.1"),
               dict(refused_client_versions=("0.1.9", "0.2.0")), dict(client_version="", min_client_version="0.1")):
        code, detail = refusal(**kw)
        assert code is RejectCode.UNSUPPORTED_VERSION and detail
    assert refusal(min_client_version="0.2.0", refused_client_versions=("0.2.1",)) is None
    assert handshake.release_tuple("0.2.0rc1") == handshake.release_tuple("v0.2") == (0, 2)
    assert handshake.release_tuple("0.10.1") > handshake.release_tuple("0.9.9")


def test_info_is_read_across_schema_versions():
    info = handshake.CoordinatorInfo(run_id="r", asyncrl_version="9.0", protocol=1, schema=7, time=1.0, window_s=300)
    raw = msgspec.structs.asdict(info)
    raw["field_from_the_future"] = [1, 2]
    got = handshake.decode_info(msgspec.msgpack.encode(raw))  # lenient: unknown fields are ignored
    assert got.schema == 7
    code, _ = handshake.coordinator_refusal(got, client_version=NOW)  # ...and the client refuses *it*
    assert code is RejectCode.UNSUPPORTED_VERSION
    refused = handshake.CoordinatorInfo(run_id="r", asyncrl_version="0.2.0", protocol=1, schema=2, time=1.0,
                                        window_s=300, refused="UNSUPPORTED_VERSION", detail="upgrade")
    assert handshake.coordinator_refusal(refused, client_version=NOW) == (RejectCode.UNSUPPORTED_VERSION, "upgrade")


def test_a_schema_1_coordinator_and_bad_requests_are_told_apart():
    with pytest.raises(ProtocolError) as err:
        handshake.decode_info(b"demo")  # asyncrl 0.1 answers the bare run id
    assert err.value.code is RejectCode.UNSUPPORTED_VERSION
    for bad, code in ((b"\x00" * (handshake.MAX_INFO_REQUEST_BYTES + 1), RejectCode.PAYLOAD_TOO_LARGE),
                      (b"\xc1", RejectCode.MALFORMED),
                      (handshake.encode(handshake.InfoRequest(dial_back_ports=(0,))), RejectCode.MALFORMED)):
        with pytest.raises(ProtocolError) as err:
            handshake.decode_request(bad)
        assert err.value.code is code


def pointer(published_at: float, sha: bytes = b"a" * 32) -> messages.AdapterPointer:
    return messages.AdapterPointer(run_id="r", version=3, manifest_sha256=sha, keyframe_version=0,
                                   published_at=published_at)


def test_the_final_pointer_is_newer_than_the_last_one_and_says_finished():
    last = envelope.seal(COORD, swarm.POINTER_KIND, messages.encode(pointer(100.0)))
    final, _ = swarm.check_pointer(swarm.finish_pointer(COORD, last, now=50.0), coordinator_key=COORD.public_key,
                                   run_id="r")
    assert final.finished and final.version == 3 and final.published_at > 100.0
    assert swarm.pointer_is_newer(final, pointer(100.0))
    assert not swarm.pointer_is_newer(pointer(300.0), final)  # same manifest, not final: nothing new
    assert swarm.pointer_is_newer(pointer(300.0, b"b" * 32), final)  # a restarted run's new version is followed
