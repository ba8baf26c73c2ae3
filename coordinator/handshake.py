"""HandshakeDesk: the coordinator's answer on the unscoped `asyncrl.info` stream (protocol/handshake.py).

A volunteer's first request, before any work: the desk answers its run id, versions and clock, applies
the version gate (`min_client_version`, `refused_client_versions`, protocol and schema: a refusal says
what to upgrade), says whether the run has finished, hands out the newest signed pointer, reports the
address it sees the caller at and — when asked — whether a TCP connection back to the caller's ports
succeeds (the doctor's NAT row). An empty request gets the bare run id, as asyncrl 0.1 volunteers expect
(they are then refused UNSUPPORTED_VERSION on their first lease request, coordinator/leasing.py).

Dial-backs cost the coordinator a connection attempt, so they go only to the caller's own observed IP,
at most MAX_DIAL_BACK_PORTS ports, DIAL_BACK_TIMEOUT_S each, and all callers together share one token
bucket (DIAL_BACKS_PER_S); past it the answer simply reports no reachable port.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Callable

from asyncrl.protocol import envelope, handshake
from asyncrl.swarm.rate import TokenBucket

DIAL_BACK_TIMEOUT_S = 2.0
DIAL_BACKS_PER_S = 5.0
DIAL_BACK_BURST = 20


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
                 environment: str = ""):
        self.run_id = run_id
        self.gate = gate
        self.window_s = window_s
        self.max_staleness = -1 if max_staleness is None else max_staleness
        self.lease_timeout_s = lease_timeout_s
        self.pointer = pointer
        self.finished = finished
        self.environment = environment  # the run's environment pin (JSON) or ""
        self.dial_backs = TokenBucket(DIAL_BACKS_PER_S, DIAL_BACK_BURST)

    async def handle(self, request: bytes, peer: str, addr: str = "") -> bytes:
        if not request:
            return self.run_id.encode()  # asyncrl 0.1's handshake
        req = handshake.decode_request(request)  # ProtocolError -> the caller gets its code
        refusal = self.gate.refusal(protocol=req.protocol, schema=req.schema, client_version=req.client_version)
        reachable = await self._dial_back(addr, req.dial_back_ports) if req.dial_back_ports else ()
        return handshake.encode(handshake.CoordinatorInfo(
            run_id=self.run_id, asyncrl_version=handshake.package_version(), protocol=handshake.PROTOCOL_VERSION,
            schema=handshake.SCHEMA_VERSION, time=envelope.clock(), window_s=self.window_s,
            refused=refusal[0].value if refusal else "", detail=refusal[1] if refusal else "",
            finished=self.finished(), pointer=self.pointer() or b"", observed_addr=addr[:256],
            reachable_ports=reachable, max_staleness=self.max_staleness, lease_timeout_s=self.lease_timeout_s,
            environment=self.environment))

    async def _dial_back(self, addr: str, ports: tuple[int, ...]) -> tuple[int, ...]:
        hit = re.match(r"/ip([46])/([^/]+)/", addr)
        if not hit:
            return ()  # relayed or unknown: nothing to dial
        host = hit.group(2)
        reachable = []
        for port in ports[:handshake.MAX_DIAL_BACK_PORTS]:
            if not self.dial_backs.take():
                break
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), DIAL_BACK_TIMEOUT_S)
                writer.close()
                reachable.append(port)
            except (OSError, asyncio.TimeoutError):
                pass
        return tuple(reachable)
