"""The volunteer's one lease RPC client: every message on the lease stream is built, sealed, sent and decoded here.

  LeaseRpc     one sealed LeaseRequest -> its decoded LeaseGrant. The request's common fields (run, name,
               client version: the coordinator's version gate applies to each of them) are filled in one place.
  LeaseCalls   what the volunteer asks with it (a mixin of the hub's `Volunteer`): work sized to this machine
               (`_lease`, `_fetch_work`: the grant's leases renewed from then on by client/lease_keeper.py),
               renewals (`_renew`), leases given back on a pause, a stop or a failed reward check
               (`_release`), a failed canary (client/session.py), and the goodbye at the end of a run.
  Work         leases granted together, on their way through the pipeline (client/pipeline.py).

LeaseCalls reads the hub's `node`, `identity`, `coordinator_peer_id`, `coordinator_key`, `run_id`, `name`,
`serving_version`, `sizer`, `status`, `display`, `stop`, and records what a grant says (`latest_version`,
`granted_at`, `max_batch_bytes`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from asyncrl.protocol import envelope, handshake, limits, messages
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.swarm import streams
from asyncrl.swarm.streams import stream_name
from asyncrl.swarm.transport import TransportError

from .lease_keeper import LeaseKeeper


class LeaseRpc:
    def __init__(self, node, identity, *, coordinator_peer_id: str, coordinator_key: bytes, run_id: str,
                 client_name: str):
        self.node = node
        self.identity = identity
        self.coordinator_peer_id = coordinator_peer_id
        self.coordinator_key = coordinator_key
        self.run_id = run_id
        self.client_name = client_name

    def call(self, *, adapter_version: int, max_prompts: int = 0, timeout: float | None = None,
             **fields) -> messages.LeaseGrant:
        """One sealed LeaseRequest; its grant. `fields`: renew / release / unscorable / seconds_per_prompt.
        Raises TransportError (unreachable) or ProtocolError (refused: its code)."""
        req = messages.LeaseRequest(run_id=self.run_id, max_prompts=max_prompts, adapter_version=adapter_version,
                                    client_name=self.client_name, client_version=handshake.package_version(),
                                    **fields)
        sealed = envelope.seal(self.identity, "lease_request", messages.encode(req), audience=self.coordinator_key)
        kw = {} if timeout is None else {"timeout": timeout}
        raw = self.node.call(self.coordinator_peer_id, stream_name(self.run_id, streams.LEASE), sealed,
                             max_response_bytes=limits.MAX_LEASE_GRANT_BYTES, **kw)
        return messages.decode(raw, messages.LeaseGrant, max_bytes=limits.MAX_LEASE_GRANT_BYTES)


# A lease refused with these ends the volunteer's run: asking again can never succeed.
FINAL_LEASE_REJECTS = {RejectCode.UNSUPPORTED_VERSION, RejectCode.NOT_ALLOWED, RejectCode.TOO_SLOW}
MAX_SIZES_KEPT = 64  # status.json keeps this many recent lease sizes
RELEASE_RETRY_S = 1.0  # a release whose answer was lost is sent once more after this


@dataclass
class Work:
    """Leases granted together, on their way through the pipeline (client/pipeline.py)."""
    leases: list
    keeper: object  # LeaseKeeper renewing them since the grant (None for an empty grant)
    granted_at: float  # monotonic
    retry_after: float = 0.0  # an empty grant: the coordinator's waiting line
    version: int = -1  # the adapter it was generated with
    generated: list = field(default_factory=list)  # (lease, samples)
    unfinished: list = field(default_factory=list)  # leases a pause left unstarted (returned)
    reason: str | None = None


class LeaseCalls:
    def _rpc(self) -> LeaseRpc:
        return LeaseRpc(self.node, self.identity, coordinator_peer_id=self.coordinator_peer_id,
                        coordinator_key=self.coordinator_key, run_id=self.run_id, client_name=self.name)

    def _lease(self) -> tuple[list[messages.TaskLease], float]:
        report, self._canary_report = self._canary_report, None
        grant = self._rpc().call(adapter_version=self.serving_version, max_prompts=self.sizer.want(),
                                 seconds_per_prompt=self.sizer.reported_rate(),  # client/lease_sizing.py
                                 canary=report)
        self.granted_at = time.monotonic()
        self.latest_version = grant.current_version
        self.sizer.observe_grant(grant)
        if grant.leases:
            self.status.lease_sizes = (self.status.lease_sizes + [len(grant.leases)])[-MAX_SIZES_KEPT:]
        self.max_batch_bytes = grant.max_batch_bytes or self.max_batch_bytes
        return list(grant.leases), grant.retry_after_s

    def _fetch_work(self) -> Work:
        """One lease request; granted leases are renewed from now on (also while they wait for the engine)."""
        leases, retry_after = self._lease()
        keeper = LeaseKeeper(self._renew, leases).__enter__() if leases else None
        return Work(leases, keeper, self.granted_at, retry_after)

    def _renew(self, lease_ids: list[str]) -> dict[str, float]:
        """One renewal-only lease request (client/lease_keeper.py): seconds left per lease id."""
        grant = self._rpc().call(adapter_version=self.serving_version, renew=tuple(lease_ids))
        return {r.lease_id: r.expires_in_s for r in grant.renewed}

    def _goodbye(self) -> None:
        """Tell the coordinator we know the run is over (an empty request it answers RUN_FINISHED), so it
        need not linger for us (coordinator/run_end.py)."""
        try:
            self._rpc().call(adapter_version=self.serving_version, timeout=5)
        except Exception:  # noqa: BLE001 - RUN_FINISHED (expected), or it is gone already: we stop either way
            pass

    def _release(self, leases: list[messages.TaskLease], reason: str | None, *, unscorable: bool = False,
                 reward_error: str = "") -> None:
        """Give leases back (a LeaseRequest with `release`): their prompts go to someone else now, instead
        of waiting out the lease timeout (coordinator/leasing/taskboard.py `release`). With `unscorable` they are
        leases whose groups our reward check could not score (`LeaseRequest.unscorable`): the coordinator
        counts them against the prompt and retires a prompt nobody can score. A lost answer is asked once
        more after RELEASE_RETRY_S, like a renewal (returning is idempotent: ids no longer held are ignored)."""
        ids = tuple(l.lease_id for l in leases)
        for attempt in range(2):
            try:
                self._rpc().call(adapter_version=self.serving_version, reward_error=reward_error,
                                 **({"unscorable": ids} if unscorable else {"release": ids}))
            except TransportError as exc:
                if attempt == 0:
                    self.stop.wait(RELEASE_RETRY_S)
                    continue
                self.display.event("warning", f"could not return {len(ids)} leases ({exc}); they will expire")
                return
            except ProtocolError as exc:  # they expire on their own, as without polite mode
                self.display.event("warning", f"could not return {len(ids)} leases ({exc}); they will expire")
                return
            if unscorable:
                self.display.event("info", f"[{self.name}] reported {len(ids)} leases we could not score ({reason})")
                return
            self._count("leases_returned", len(ids))
            self.display.event("info", f"[{self.name}] returned {len(ids)} unfinished leases ({reason})")
            return

    def _measured(self, prompts: int, granted_at: float) -> None:
        """Grant to ack (or to losing the leases), per prompt: the sizer's measurement (client/lease_sizing.py)."""
        self.sizer.measured(prompts, time.monotonic() - granted_at)
        self.status.seconds_per_prompt = round(self.sizer.seconds_per_prompt, 3)

