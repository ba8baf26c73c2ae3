"""The `asyncrl.info` handshake: versions, the version gate, the coordinator's clock and run state. Pure.

A volunteer's first request (before any work, and what `asyncrl-client doctor` reads) is an
`InfoRequest` on the unscoped `asyncrl.info` stream; the coordinator answers a `CoordinatorInfo`: run id,
its versions, whether this client may join (and if not, what to upgrade), its clock (`time`, for the
clock-offset check against the envelope window), whether the run has finished, its newest signed
pointer (verified against the join address without the DHT), and how it sees the caller (observed
address, and whether a TCP dial back to the caller's ports worked: the NAT check). An empty request
still gets the bare run id, as schema-1 volunteers expect.

These two structs are the one exchange read *across* schema versions, so they are lenient where every
other message is strict: unknown fields are ignored and there is no schema check on decode. Extend them
with defaulted fields; never remove or retype one.

Three numbers describe a peer:

    protocol   PROTOCOL_VERSION: the envelope format (envelope.MAGIC "ARL1"); changes break everything
    schema     messages.SCHEMA_VERSION: the message layout; both sides must speak the same one
    release    the asyncrl package version (`package_version()`), e.g. "0.2.0"

The gate (`client_refusal`) refuses a client whose protocol or schema differs from the coordinator's,
whose release is older than the run's `min_client_version`, or that is one of the run's known-bad
releases (`refused_client_versions`). Every refusal is UNSUPPORTED_VERSION with a detail that names both
sides' versions and says which side to upgrade. The coordinator answers it on the `asyncrl.info` stream
(a client learns it before it asks for work: messages.InfoRequest / CoordinatorInfo) and again on
every lease request, for clients that skipped the handshake.

Release comparison is by the leading numeric components ("0.2.0rc1" compares as 0.2.0): enough for a
minimum and a refusal list without a packaging dependency in protocol/.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

from .envelope import PROTOCOL_VERSION
from .errors import ProtocolError, RejectCode
from .messages import SCHEMA_VERSION

PACKAGE = "asyncrl"
MAX_INFO_REQUEST_BYTES = 1024
MAX_INFO_BYTES = 16 * 1024
MAX_DIAL_BACK_PORTS = 4
_Text = Annotated[str, msgspec.Meta(max_length=256)]


MAX_REWARD_PACKAGES = 16  # 16 x 3 x 64 characters: the answer stays within MAX_INFO_BYTES with a full pointer
MAX_MISSING_REWARDS = 8
_Short = Annotated[str, msgspec.Meta(max_length=64)]


class RewardPackage(msgspec.Struct, frozen=True, kw_only=True):
    """A reward the run scores with and the installed distribution it comes from (its `asyncrl.rewards`
    entry point): every volunteer needs the same package at the same version (tasks.reward_package)."""

    reward: _Short
    package: _Short
    version: _Short


def install_line(packages) -> str:
    """The pip command that installs `packages` (RewardPackage) at the run's versions, each package once."""
    return "pip install " + " ".join(f"'{name}=={version}'" for name, version in package_versions(packages))


def package_versions(packages) -> list[tuple[str, str]]:
    """(package, version) of `packages` (RewardPackage), each once, in order."""
    return list(dict.fromkeys((p.package, p.version) for p in packages))


class InfoRequest(msgspec.Struct, frozen=True, kw_only=True):
    client_version: _Text = ""
    protocol: int = PROTOCOL_VERSION
    schema: int = SCHEMA_VERSION
    dial_back_ports: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_DIAL_BACK_PORTS)] = ()
    """TCP ports the coordinator should try to connect back to on the caller's observed IP (NAT check)."""
    missing_rewards: Annotated[tuple[_Short, ...], msgspec.Meta(max_length=MAX_MISSING_REWARDS)] = ()
    """Rewards of `CoordinatorInfo.reward_packages` this client lacks (or has at another version): it will not
    join; said so the operator sees it. Answered REWARD_PACKAGE_MISSING with the install line."""


class CoordinatorInfo(msgspec.Struct, frozen=True, kw_only=True):
    run_id: _Text
    asyncrl_version: _Text
    protocol: int
    schema: int
    time: float  # the coordinator's clock when it answered
    window_s: float  # envelope timestamp window (EXPIRED beyond it)
    refused: _Text = ""  # a RejectCode value when this client may not join; "" = welcome
    detail: Annotated[str, msgspec.Meta(max_length=2048)] = ""  # what to upgrade
    finished: bool = False  # the run is over (max_steps reached or stopped for good)
    pointer: Annotated[bytes, msgspec.Meta(max_length=8192)] = b""  # newest sealed AdapterPointer
    observed_addr: _Text = ""  # the caller's address as the coordinator sees it
    reachable_ports: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_DIAL_BACK_PORTS)] = ()
    max_staleness: int = -1  # versions; -1 = unlimited
    lease_timeout_s: float = 0.0
    # the run's environment pin, JSON {"name", "package", "version", "sha256"} (envs/base.py `pin`); "" = the
    # run has single-answer tasks. A volunteer without the same environment does not start (client/checks.py).
    environment: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    # the packages the run's rewards come from (built-ins, which ship with asyncrl, are not listed)
    reward_packages: Annotated[tuple[RewardPackage, ...], msgspec.Meta(max_length=MAX_REWARD_PACKAGES)] = ()


_info_encoder = msgspec.msgpack.Encoder()


def encode(msg: InfoRequest | CoordinatorInfo) -> bytes:
    return _info_encoder.encode(msg)


def decode_request(data: bytes) -> InfoRequest:
    """MALFORMED for anything that is not an InfoRequest (an empty request is the caller's business)."""
    if len(data) > MAX_INFO_REQUEST_BYTES:
        raise ProtocolError(RejectCode.PAYLOAD_TOO_LARGE, f"{len(data)} bytes > {MAX_INFO_REQUEST_BYTES}")
    try:
        req = msgspec.msgpack.decode(data, type=InfoRequest)
    except Exception as exc:
        raise ProtocolError(RejectCode.MALFORMED, f"info request: {exc}") from None
    if any(type(p) is not int or not 0 < p < 65536 for p in req.dial_back_ports):
        raise ProtocolError(RejectCode.MALFORMED, "dial_back_ports must be TCP ports")
    return req


def decode_info(data: bytes) -> CoordinatorInfo:
    """The coordinator's answer. A bare run id (a schema-1 coordinator) is UNSUPPORTED_VERSION."""
    if len(data) > MAX_INFO_BYTES:
        raise ProtocolError(RejectCode.PAYLOAD_TOO_LARGE, f"{len(data)} bytes > {MAX_INFO_BYTES}")
    try:
        info = msgspec.msgpack.decode(data, type=CoordinatorInfo)
    except Exception:
        raise ProtocolError(RejectCode.UNSUPPORTED_VERSION,
                            "the coordinator answered the handshake of asyncrl 0.1 (schema 1), not a CoordinatorInfo: "
                            f"{upgrade_hint('coordinator', '0.1.0')}") from None
    if type(info.time) not in (int, float) or type(info.window_s) not in (int, float):
        raise ProtocolError(RejectCode.MALFORMED, "coordinator info: time/window_s must be numbers")
    return info


def coordinator_refusal(info: CoordinatorInfo, *, client_version: str) -> tuple[RejectCode, str] | None:
    """The client's side of the gate: the coordinator's refusal, or our own when we cannot speak its schema."""
    if info.refused:
        try:
            return RejectCode(info.refused), info.detail
        except ValueError:
            return RejectCode.UNSUPPORTED_VERSION, info.detail
    return client_refusal(client_protocol=PROTOCOL_VERSION, client_schema=SCHEMA_VERSION,
                          client_version=client_version, coordinator_version=info.asyncrl_version,
                          coordinator_protocol=info.protocol, coordinator_schema=info.schema)


def package_version() -> str:
    """This installation's asyncrl release ("0+unknown" when run from a tree that was never installed)."""
    from importlib import metadata

    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return "0+unknown"


def release_tuple(version: str) -> tuple[int, ...]:
    """(0, 2, 0) for "0.2.0", "0.2.0rc1" and "v0.2"; () when no leading number."""
    m = re.match(r"v?(\d+(?:\.\d+)*)", version.strip())
    if not m:
        return ()
    parts = [int(p) for p in m.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def upgrade_hint(side: str, to: str) -> str:
    """What to run: `side` ("client" or "coordinator") is the older one, `to` the release to reach."""
    # asyncrl is not on a package index: the coordinator's release is its wheel or a clone at its commit
    return (f"upgrade the volunteer to {PACKAGE} {to}: the coordinator's wheel ({PACKAGE}-{to}-*.whl) or "
            "pip install -e . in a clone at its commit (docs/gpu-swarm.md)" if side == "client"
            else f"the coordinator runs an older {PACKAGE}; join it with {PACKAGE} {to} (its wheel, or a clone at "
                 "its commit) or ask its operator to upgrade")


def client_refusal(*, client_protocol: int, client_schema: int, client_version: str, coordinator_version: str,
                   min_client_version: str = "", refused_client_versions: tuple[str, ...] = (),
                   coordinator_protocol: int = PROTOCOL_VERSION, coordinator_schema: int = SCHEMA_VERSION
                   ) -> tuple[RejectCode, str] | None:
    """None if the coordinator accepts this client, else (UNSUPPORTED_VERSION, what to upgrade)."""
    both = (f"volunteer: asyncrl {client_version or '?'} (protocol {client_protocol}, schema {client_schema}); "
            f"coordinator: asyncrl {coordinator_version} (protocol {coordinator_protocol}, schema {coordinator_schema})")
    if client_protocol != coordinator_protocol or client_schema != coordinator_schema:
        older = (client_protocol, client_schema) < (coordinator_protocol, coordinator_schema)
        side, to = ("client", coordinator_version) if older else ("coordinator", client_version or "?")
        return RejectCode.UNSUPPORTED_VERSION, f"{both}: {upgrade_hint(side, to)}"
    mine = release_tuple(client_version)
    if client_version and any(mine and mine == release_tuple(bad) for bad in refused_client_versions):
        return RejectCode.UNSUPPORTED_VERSION, (f"{both}: asyncrl {client_version} is a known-bad release for this "
                                                f"run; upgrade the volunteer: pip install -U '{PACKAGE}!={client_version}'")
    if min_client_version and (not mine or mine < release_tuple(min_client_version)):
        return RejectCode.UNSUPPORTED_VERSION, (f"{both}: this run needs asyncrl >= {min_client_version}; "
                                                f"{upgrade_hint('client', min_client_version)}")
    return None
