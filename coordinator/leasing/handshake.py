"""HandshakeDesk: the coordinator's answer on the unscoped `asyncrl.info` stream (protocol/handshake.py).

A volunteer's first request, before any work: the desk answers its run id, versions and clock, applies
the version gate (`min_client_version`, `refused_client_versions`, protocol and schema: a refusal says
what to upgrade), says whether the run has finished, hands out the newest signed pointer, reports the
address it sees the caller at and — when asked — whether a TCP connection back to the caller's ports
succeeds (the doctor's NAT row). An empty request gets the bare run id, as asyncrl 0.1 volunteers expect
(they are then refused UNSUPPORTED_VERSION on their first lease request, coordinator/leasing/leasing.py).

Budgets (the stream itself passes the node's inbound gate, swarm/inbound.py, like every stream):
  * each peer id has its own bucket for info requests (`admit`, before the request is read: INFO_PER_PEER_RATE
    per second, INFO_PER_PEER_BURST at once; RATE_LIMITED past it), so one flooder is answered at that rate
    however fast it asks, and nobody else's handshake waits behind it;
  * dial-backs cost a connection attempt, so they go only to the caller's own observed IP, and only to the
    ports it legitimately has: the port it is seen connecting from and those its libp2p node announces
    (`announced_ports(peer)`: its identify addresses) — a request for any other port is not dialled; at most
    MAX_DIAL_BACK_PORTS ports, DIAL_BACK_TIMEOUT_S each; each peer has its own allowance
    (DIAL_BACKS_PER_PEER_BURST, then one per DIAL_BACK_PEER_EVERY_S) inside an overall bound
    (DIAL_BACKS_PER_S), so a flooder spends its own allowance, not an honest doctor's. Past either, the answer
    simply reports no reachable port.
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable

from asyncrl.protocol import envelope, handshake
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.swarm.rate import TokenBucket

DIAL_BACK_TIMEOUT_S = 2.0
DIAL_BACKS_PER_S = 20.0
DIAL_BACK_BURST = 80
DIAL_BACKS_PER_PEER_BURST = handshake.MAX_DIAL_BACK_PORTS  # one doctor run's ports at once...
DIAL_BACK_PEER_EVERY_S = 15.0  # ...then one more port this often
INFO_PER_PEER_RATE, INFO_PER_PEER_BURST = 2.0, 20  # a volunteer asks once per join, the doctor a few times
MAX_PEERS_TRACKED = 10_000  # per-peer buckets kept (least recently used forgotten: they start afresh)


@dataclass(frozen=True)
class GatePolicy:
    min_client_version: str = ""
    refused_client_versions: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, cfg) -> "GatePolicy":
        return cls(min_client_version=cfg.min_client_version,
                   refused_client_versions=tuple(cfg.refused_client_versions))

    def refusal(self, *, protocol: int, schema: int, client_version: str):
        return handshake.client_refusal(client_protocol=protocol, client_schema=schema, client_version=client_version,
                                        coordinator_version=handshake.package_version(),
                                        min_client_version=self.min_client_version,
                                        refused_client_versions=self.refused_client_versions)


class HandshakeDesk:
    def __init__(self, *, run_id: str, gate: GatePolicy, window_s: float, max_staleness: int | None,
                 lease_timeout_s: float, pointer: Callable[[], bytes | None], finished: Callable[[], bool],
                 announced_ports: Callable[[str], Awaitable[set[int]]] | None = None, clock=None,
                 environment: str = "",
                 reward_packages: tuple[handshake.RewardPackage, ...] = (),
                 on_refusal: Callable[[dict], None] | None = None):
        self.run_id = run_id
        self.gate = gate
        self.window_s = window_s
        self.max_staleness = -1 if max_staleness is None else max_staleness
        self.lease_timeout_s = lease_timeout_s
        self.pointer = pointer
        self.finished = finished
        self.environment = environment  # the run's environment pin (JSON) or ""
        self.reward_packages = tuple(reward_packages)  # what every volunteer must have installed
        self.on_refusal = on_refusal  # the operator's view of who was turned away at the door, and why
        self._clock = clock  # None: monotonic (TokenBucket's default)
        self.dial_backs = TokenBucket(DIAL_BACKS_PER_S, DIAL_BACK_BURST, self._now())
        self.announced_ports = announced_ports  # peer -> the TCP ports its node announces (None: none known)
        self._info: OrderedDict[str, TokenBucket] = OrderedDict()
        self._dials: OrderedDict[str, TokenBucket] = OrderedDict()
        self.counters = {"info_rate_limited": 0, "dial_backs": 0, "dial_backs_refused": 0, "ports_not_announced": 0}

    def _bucket(self, table: OrderedDict, peer: str, rate: float, burst: float) -> TokenBucket:
        bucket = table.get(peer)
        if bucket is None:
            bucket = table[peer] = TokenBucket(rate, burst, self._now())
            while len(table) > MAX_PEERS_TRACKED:
                table.popitem(last=False)
        else:
            table.move_to_end(peer)
        return bucket

    def _now(self):
        return self._clock() if self._clock is not None else None

    def admit(self, peer: str) -> None:
        """Before an info request is read (the node's event loop): the peer's own bucket, or RATE_LIMITED."""
        if not self._bucket(self._info, peer, INFO_PER_PEER_RATE, INFO_PER_PEER_BURST).take(self._now()):
            self.counters["info_rate_limited"] += 1
            raise ProtocolError(RejectCode.RATE_LIMITED, "too many handshakes from this peer; retry later")

    async def handle(self, request: bytes, peer: str, addr: str = "") -> bytes:
        if not request:
            return self.run_id.encode()  # asyncrl 0.1's handshake
        req = handshake.decode_request(request)  # ProtocolError -> the caller gets its code
        refusal = self.gate.refusal(protocol=req.protocol, schema=req.schema, client_version=req.client_version)
        if refusal is None and req.missing_rewards:  # the volunteer checked our reward_packages and lacks some
            refusal = self.missing_rewards(req.missing_rewards)
        if refusal is not None and self.on_refusal is not None:
            self.on_refusal({"peer": peer, "addr": addr[:256], "client_version": req.client_version,
                             "code": refusal[0].value, "detail": refusal[1]})
        reachable = await self._dial_back(peer, addr, req.dial_back_ports) if req.dial_back_ports else ()
        return handshake.encode(handshake.CoordinatorInfo(
            run_id=self.run_id, asyncrl_version=handshake.package_version(), protocol=handshake.PROTOCOL_VERSION,
            schema=handshake.SCHEMA_VERSION, time=envelope.clock(), window_s=self.window_s,
            refused=refusal[0].value if refusal else "", detail=refusal[1] if refusal else "",
            finished=self.finished(), pointer=self.pointer() or b"", observed_addr=addr[:256],
            reachable_ports=reachable, max_staleness=self.max_staleness, lease_timeout_s=self.lease_timeout_s,
            environment=self.environment, reward_packages=self.reward_packages))

    def missing_rewards(self, names) -> tuple:
        """REWARD_PACKAGE_MISSING with the install line for the packages of the rewards `names`."""
        from asyncrl.protocol.errors import RejectCode

        wanted = [p for p in self.reward_packages if p.reward in set(names)] or list(self.reward_packages)
        return (RejectCode.REWARD_PACKAGE_MISSING,
                f"this run's rewards {', '.join(repr(p.reward) for p in wanted)} come from "
                f"{', '.join(f'{n} {v}' for n, v in handshake.package_versions(wanted))}: "
                f"{handshake.install_line(wanted)}"[:2000])

    async def _dial_back(self, peer: str, addr: str, ports: tuple[int, ...]) -> tuple[int, ...]:
        hit = re.match(r"/ip([46])/([^/]+)/", addr)
        if not hit:
            return ()  # relayed or unknown: nothing to dial
        host = hit.group(2)
        allowed = set(int(p) for p in re.findall(r"/tcp/(\d+)", addr))  # the port it is seen connecting from
        if self.announced_ports is not None:
            try:
                allowed |= await self.announced_ports(peer)
            except Exception:  # noqa: BLE001 - the daemon could not say: the observed port only
                pass
        mine = self._bucket(self._dials, peer, 1.0 / DIAL_BACK_PEER_EVERY_S, DIAL_BACKS_PER_PEER_BURST)
        reachable = []
        for port in ports[:handshake.MAX_DIAL_BACK_PORTS]:
            if port not in allowed:
                self.counters["ports_not_announced"] += 1
                continue
            if not mine.take(self._now()) or not self.dial_backs.take(self._now()):
                self.counters["dial_backs_refused"] += 1
                break
            self.counters["dial_backs"] += 1
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), DIAL_BACK_TIMEOUT_S)
                writer.close()
                reachable.append(port)
            except (OSError, asyncio.TimeoutError):
                pass
        return tuple(reachable)
