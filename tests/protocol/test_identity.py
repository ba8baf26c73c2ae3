"""Identity: peer ids, key files, libp2p identity file, signatures (real Ed25519, no mocks)."""

from __future__ import annotations

import hashlib
import os
import random
import stat

import pytest

from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import (
    Identity,
    fingerprint,
    peer_id_from_public_key,
    public_key_from_peer_id,
    verify_signature,
)

# Known answer, cross-checked against the `base58` package and hivemind's PeerID.from_base58.
SEED = bytes(range(32))
SEED_PUB = bytes.fromhex("03a107bff3ce10be1d70dd18e74bc09967e4d6309ba50d5f1ddc8664125531b8")
SEED_PEER_ID = "12D3KooWA4Xop1JaT3MHxwYMkCepYsv4iPVopMXwCz5iHYdBfeSB"


def test_known_answer_peer_id():
    alice = Identity.from_seed(SEED)
    assert alice.public_key == SEED_PUB
    assert alice.peer_id == SEED_PEER_ID
    assert public_key_from_peer_id(SEED_PEER_ID) == SEED_PUB
    assert alice.fingerprint == fingerprint(SEED_PUB) == "5647:5aa7:5463:474c"


def test_peer_id_round_trip():
    for _ in range(20):
        ident = Identity.generate()
        pid = ident.peer_id
        assert pid.startswith("12D3KooW")
        assert public_key_from_peer_id(pid) == ident.public_key
    assert peer_id_from_public_key(bytes(32)).startswith("12D3KooW")


@pytest.mark.parametrize(
    "bad",
    [
        "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",  # RSA-style sha256 multihash
        "",
        "not-base58-0OIl",
        "12D3KooW",
        SEED_PEER_ID[:-1],
        SEED_PEER_ID + "1",
        "1" * 500,
    ],
)
def test_public_key_from_bad_peer_id(bad):
    with pytest.raises(ProtocolError) as e:
        public_key_from_peer_id(bad)
    assert e.value.code is RejectCode.MALFORMED


def test_public_key_from_non_string():
    with pytest.raises(ProtocolError) as e:
        public_key_from_peer_id(b"12D3KooW")  # type: ignore[arg-type]
    assert e.value.code is RejectCode.MALFORMED


def test_sign_and_verify():
    alice, mallory = Identity.generate(), Identity.generate()
    sig = alice.sign(b"hello")
    assert len(sig) == 64
    verify_signature(alice.public_key, sig, b"hello")
    for pub, s, data in [
        (alice.public_key, sig, b"hellO"),
        (mallory.public_key, sig, b"hello"),
        (alice.public_key, sig[:-1], b"hello"),
        (alice.public_key[:31], sig, b"hello"),
        (alice.public_key, bytes(64), b"hello"),
    ]:
        with pytest.raises(ProtocolError) as e:
            verify_signature(pub, s, data)
        assert e.value.code is RejectCode.SIGNATURE_MISMATCH


def test_save_load_round_trip_and_permissions(tmp_path):
    path = tmp_path / "deep" / "dir" / "coordinator.key"
    alice, created = Identity.load_or_create(path)
    assert created
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    again, created = Identity.load_or_create(path)
    assert not created
    assert again.public_key == alice.public_key
    assert Identity.load(path).peer_id == alice.peer_id
    assert [p.name for p in path.parent.iterdir()] == ["coordinator.key"]  # no temp files left


def test_group_readable_key_file_warns(tmp_path):
    path = tmp_path / "k.pem"
    Identity.generate().save(path)
    os.chmod(path, 0o644)
    with pytest.warns(UserWarning):
        Identity.load(path)


@pytest.mark.parametrize(
    "content",
    [b"", b"garbage", b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", random.Random(64).randbytes(64)],
)
def test_corrupt_key_file_is_malformed(tmp_path, content):
    path = tmp_path / "broken.key"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    with pytest.raises(ProtocolError) as e:
        Identity.load_or_create(path)
    assert e.value.code is RejectCode.MALFORMED


def test_non_ed25519_key_file_is_malformed(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    pem = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path = tmp_path / "ec.key"
    path.write_bytes(pem)
    os.chmod(path, 0o600)
    with pytest.raises(ProtocolError) as e:
        Identity.load(path)
    assert e.value.code is RejectCode.MALFORMED


def test_libp2p_identity_file_layout(tmp_path):
    alice = Identity.from_seed(SEED)
    path = tmp_path / "p2p" / "identity.bin"
    alice.write_libp2p_identity(path)
    data = path.read_bytes()
    assert data == bytes([0x08, 0x01, 0x12, 64]) + SEED + SEED_PUB
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_identity_never_shows_or_pickles_private_key():
    import pickle

    alice = Identity.from_seed(SEED)
    assert SEED.hex() not in repr(alice)
    with pytest.raises(TypeError):
        pickle.dumps(alice)


def test_fingerprint_shape():
    fp = fingerprint(os.urandom(32))
    assert len(fp) == 19 and fp.count(":") == 3
    assert fingerprint(SEED_PUB).replace(":", "") == hashlib.sha256(SEED_PUB).hexdigest()[:16]
