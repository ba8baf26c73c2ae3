"""Ed25519 identities: key files, signatures, and libp2p peer ids.

One key pair is a peer's identity everywhere: it signs envelopes (see `envelope.py`), and written as a
libp2p identity file it makes hivemind's p2pd announce the matching peer id, so the join address an
operator shares (which contains the coordinator's peer id) is also the trust anchor for its signatures.

Key file formats:
  * `Identity.save/load`: PKCS#8 PEM, unencrypted ("-----BEGIN PRIVATE KEY-----"), mode 0600. Readable
    by `openssl pkey`; protect it with file permissions, not a passphrase (daemons restart unattended).
  * `Identity.write_libp2p_identity`: libp2p protobuf `PrivateKey{Type=Ed25519, Data=seed||pub}`,
    i.e. bytes([0x08, 0x01, 0x12, 64]) + seed + pub; p2pd accepts it via `identity_path=`.
Every file is written to a temp name in the same folder and renamed over the target.

Peer ids are the libp2p "identity multihash" form used for Ed25519 keys ("12D3KooW..."):
base58btc(0x00 0x24 || 0x08 0x01 0x12 0x20 || pub). base58 is implemented here (twenty lines) rather
than taken as a dependency.
"""

from __future__ import annotations

import hashlib
import os
import stat
import warnings
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .atomic import write_atomic
from .errors import ProtocolError, RejectCode

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64

# libp2p protobuf headers: field 1 (KeyType) = 1 (Ed25519), field 2 (Data) of the given length.
_PUBKEY_PB_HEADER = bytes([0x08, 0x01, 0x12, PUBLIC_KEY_BYTES])
_PRIVKEY_PB_HEADER = bytes([0x08, 0x01, 0x12, 2 * PUBLIC_KEY_BYTES])
# multihash "identity" (code 0x00) of the 36-byte protobuf above.
_PEER_ID_PREFIX = bytes([0x00, len(_PUBKEY_PB_HEADER) + PUBLIC_KEY_BYTES]) + _PUBKEY_PB_HEADER
_PEER_ID_BYTES = len(_PEER_ID_PREFIX) + PUBLIC_KEY_BYTES
_MAX_PEER_ID_CHARS = 128  # refuse silly inputs before the (quadratic) base58 decode

_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_B58_INDEX = {c: i for i, c in enumerate(_B58_ALPHABET)}


def _b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58_ALPHABET[r])
    zeros = len(data) - len(data.lstrip(b"\x00"))
    return "1" * zeros + "".join(reversed(out))


def _b58decode(text: str) -> bytes:
    n = 0
    for c in text:
        digit = _B58_INDEX.get(c)
        if digit is None:
            raise ValueError(f"not a base58 character: {c!r}")
        n = n * 58 + digit
    zeros = len(text) - len(text.lstrip("1"))
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    return b"\x00" * zeros + body


def peer_id_from_public_key(pub: bytes) -> str:
    """The libp2p peer id ("12D3KooW...") of a raw 32-byte Ed25519 public key."""
    pub = bytes(pub)
    if len(pub) != PUBLIC_KEY_BYTES:
        raise ProtocolError(RejectCode.MALFORMED, f"Ed25519 public key must be 32 bytes, got {len(pub)}")
    return _b58encode(_PEER_ID_PREFIX + pub)


def public_key_from_peer_id(peer_id: str) -> bytes:
    """Inverse of `peer_id_from_public_key`; any other peer id form raises MALFORMED."""
    if not isinstance(peer_id, str) or not 0 < len(peer_id) <= _MAX_PEER_ID_CHARS:
        raise ProtocolError(RejectCode.MALFORMED, "not an Ed25519 peer id (bad type or length)")
    try:
        raw = _b58decode(peer_id)
    except ValueError as e:
        raise ProtocolError(RejectCode.MALFORMED, f"not an Ed25519 peer id ({e})") from None
    if len(raw) != _PEER_ID_BYTES or not raw.startswith(_PEER_ID_PREFIX):
        raise ProtocolError(RejectCode.MALFORMED, "not an Ed25519 peer id (expected identity multihash of an Ed25519 key)")
    return raw[len(_PEER_ID_PREFIX):]


def fingerprint(public_key: bytes) -> str:
    """Short human form of a key for logs and dashboards: "ab12:cd34:ef56:7890" (sha256, 64 bits)."""
    h = hashlib.sha256(bytes(public_key)).hexdigest()[:16]
    return ":".join(h[i : i + 4] for i in range(0, 16, 4))


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> None:
    """Raise ProtocolError(SIGNATURE_MISMATCH) unless `signature` is `public_key`'s over `data`."""
    try:
        if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
            raise ValueError("wrong key or signature length")
        Ed25519PublicKey.from_public_bytes(bytes(public_key)).verify(bytes(signature), bytes(data))
    except (InvalidSignature, ValueError, TypeError):
        raise ProtocolError(RejectCode.SIGNATURE_MISMATCH, "Ed25519 signature does not verify") from None


def _write_private_file(path: str | os.PathLike, data: bytes) -> None:
    """Atomically write `data` to `path` with mode 0600 (a key never exists with wider permissions)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data, mode=0o600)


class Identity:
    """An Ed25519 key pair. Never prints or pickles its private half."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        if not isinstance(private_key, Ed25519PrivateKey):
            raise TypeError("Identity needs an Ed25519PrivateKey")
        self._key = private_key
        self._public = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """Deterministic identity from a 32-byte seed (tests, known-answer vectors)."""
        return cls(Ed25519PrivateKey.from_private_bytes(bytes(seed)))

    @classmethod
    def load(cls, path: str | os.PathLike) -> Identity:
        """Load a PKCS#8 PEM key file written by `save`; a corrupt file raises MALFORMED."""
        path = Path(path)
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            warnings.warn(f"identity file {path} is accessible by group/others (mode {mode & 0o777:o}); chmod 600 it",
                          stacklevel=2)
        data = path.read_bytes()
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as e:
            raise ProtocolError(RejectCode.MALFORMED, f"identity file {path} is not an unencrypted PKCS#8 PEM key: {e}") from None
        except Exception as e:  # cryptography raises UnsupportedAlgorithm etc. for odd inputs
            raise ProtocolError(RejectCode.MALFORMED, f"identity file {path} is unreadable: {e}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ProtocolError(RejectCode.MALFORMED, f"identity file {path} holds a {type(key).__name__}, not an Ed25519 key")
        return cls(key)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike) -> tuple[Identity, bool]:
        """Load the key at `path`, or generate and save one there. Returns (identity, created)."""
        if Path(path).exists():
            return cls.load(path), False
        ident = cls.generate()
        ident.save(path)
        return ident, True

    def save(self, path: str | os.PathLike) -> None:
        """Write the key as unencrypted PKCS#8 PEM, mode 0600, atomically."""
        pem = self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        _write_private_file(path, pem)

    def write_libp2p_identity(self, path: str | os.PathLike) -> None:
        """Write the key as a libp2p protobuf PrivateKey (for p2pd's `identity_path=`), mode 0600."""
        seed = self._key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        _write_private_file(path, _PRIVKEY_PB_HEADER + seed + self._public)

    @property
    def public_key(self) -> bytes:
        return self._public

    @property
    def fingerprint(self) -> str:
        return fingerprint(self._public)

    @property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self._public)

    def sign(self, data: bytes) -> bytes:
        """64-byte Ed25519 signature over `data`."""
        return self._key.sign(bytes(data))

    def __repr__(self) -> str:
        return f"Identity({self.fingerprint})"

    def __reduce__(self):
        raise TypeError("Identity is not picklable (it holds a private key); pass the key file path instead")
