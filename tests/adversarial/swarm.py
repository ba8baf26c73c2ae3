"""The adversarial suite's cast: one real swarm (coordinator, alice, bob as OS processes) and mallory.

alice and bob are ordinary `asyncrl-client join` processes. mallory is this test process: she uses the
real transport (`asyncrl.swarm.transport.SwarmNode`), the real protocol code (envelopes, messages) and a real
engine to craft her batches, so each attack reaches the coordinator exactly as it would over the
internet. Results go to tests/artifacts/adversarial.json (rendered into docs/SECURITY.md by
`python -m tests.adversarial.report`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from asyncrl.protocol import envelope, messages
from asyncrl.protocol.errors import ProtocolError, RejectCode
from asyncrl.protocol.identity import Identity, fingerprint, public_key_from_peer_id
from asyncrl.runlog import read_events
from asyncrl.swarm.streams import stream_name

from tests.conftest import wait_for  # one polling helper for every suite (re-exported below)

REPO = Path(__file__).resolve().parents[2]
ARTIFACT = REPO / "tests" / "artifacts" / "adversarial.json"
RUN_ID = "adv"

MiB = 1024 * 1024
INBOUND_BYTES, MIN_UPLOAD_BPS = 32 * MiB, 1 * MiB  # strangers together may hold 16 MiB; a body must arrive at 1 MiB/s
SERVE_NEW_BPS, SERVE_NEW_PEER_BPS, SERVE_BURST = 256 * 1024, 128 * 1024, 4 * MiB
# The suite's coordinator flags: honest volunteers stay far inside every limit; mallory's floods do not.
# Leases last 30 s (honest volunteers renew theirs): every attack that dies before its leases are known (a payload
# that does not decode) pins them, and fresh keys share new_key_share of the room together, so with the 60 s default
# the suite's later fresh keys waited up to a minute per lease (a CI run timed out test_repeat_offender_is_banned).
MAX_STALENESS = 16  # versions a claim may lag the learner's and still be trained (and audited)
COORDINATOR_FLAGS = ["--run-id", RUN_ID, "--max-steps", "0", "--threads", "1", "--groups-per-step", "8",
                     "--max-staleness", str(MAX_STALENESS),
                     "--max-wait-s", "2", "--max-inflight-groups", "32", "--lease-timeout-s", "30", "--checkpoint-every", "0",
                     "--no-dashboard",
                     "--identity-rate", "40", "--identity-burst", "80", "--peer-rate", "80", "--peer-burst", "160",
                     "--new-identity-rate", "0.5", "--new-identity-burst", "10", "--max-strikes", "3",
                     "--peer-max-strikes", "10",
                     # inbound budgets small enough for the floods below to reach them (honest batches are KBs)
                     "--inbound-bytes", str(INBOUND_BYTES), "--min-upload-bps", str(MIN_UPLOAD_BPS),
                     "--serve-new-bps", str(SERVE_NEW_BPS), "--serve-new-peer-bps", str(SERVE_NEW_PEER_BPS)]
NEW_IDENTITY_BURST, NEW_IDENTITY_RATE = 10, 0.5
IDENTITY_BURST, IDENTITY_RATE, PEER_BURST = 80, 40.0, 160
MAX_STRIKES, PEER_MAX_STRIKES = 3, 10


NOT_LOST = {"DUPLICATE_BATCH", "RATE_LIMITED", "DEADLINE_EXCEEDED", "INTERNAL", "EXPIRED", "NONCE_REUSED"}


def start_volunteers(procs, join: str, root: Path, names, *flags: str, env: dict | None = None) -> dict[str, Path]:
    """One `asyncrl-client join` process per name (seed 1, 2, ...; data dir root/<name>); name -> data dir."""
    honest = {}
    for seed, name in enumerate(names, 1):
        honest[name] = root / name
        procs.start(name, ["-m", "asyncrl.client.cli", "join", join, "--name", name, "--data-dir", str(root / name),
                           "--seed", str(seed), "--threads", "1", *flags, "--quiet"], env=env or {})
    return honest


@contextlib.contextmanager
def own_rows(swarm: "Swarm", artifact_name: str, timeout: float = 300.0):
    """A module with a swarm of its own: wait (up to `timeout`) until each honest volunteer had a batch accepted,
    run the block, then write its rows and the honest books to tests/artifacts/<artifact_name> (merged into
    docs/SECURITY.md by tests.adversarial.report)."""
    wait_for(lambda: all(swarm.status(n).get("batches_acked", 0) >= 1 for n in swarm.honest), timeout,
             f"{' and '.join(swarm.honest)} to get a batch accepted")
    start = swarm.honest_view()
    yield swarm
    write_artifact(swarm, {"honest_start": start, "honest_end": swarm.honest_view(),
                           "books": swarm.trust().get("books")}, name=artifact_name)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def refresh(sync):
    """`sync.refresh()`, except that a version the coordinator pruned mid-fetch (it published past it:
    STALE_VERSION) reads as "nothing yet" — the next poll sees the newer pointer, as a volunteer's follower
    loop (client/adapter_sync.py) does."""
    try:
        return sync.refresh()
    except ProtocolError as exc:
        if exc.code is not RejectCode.STALE_VERSION:
            raise
        return None

@dataclass
class Swarm:
    root: Path
    run: Path
    join: str
    coordinator_pid: int
    honest: dict[str, Path]  # name -> data dir
    results: dict = field(default_factory=dict)
    unanswered: list = field(default_factory=list)  # mallory's uploads whose stream broke with no answer, re-sent

    @property
    def coordinator_peer(self) -> str:
        return self.join.rsplit("/p2p/", 1)[1]

    @property
    def coordinator_key(self) -> bytes:
        return public_key_from_peer_id(self.coordinator_peer)

    def trust(self) -> dict:
        return read_json(self.run / "trust.json") or {"clients": {}, "verdicts": []}

    def status(self, name: str) -> dict:
        return read_json(self.honest[name] / "status.json") or {}

    def honest_key(self, name: str) -> bytes:
        return Identity.load(self.honest[name] / "identity.key").public_key  # only its public half is used

    def honest_view(self) -> dict:
        """alice's and bob's books, as the coordinator (trust.json) and they themselves (status.json) keep them."""
        trust = self.trust()
        out = {}
        for name in self.honest:
            st = self.status(name)
            coord = trust["clients"].get(st.get("fingerprint", ""), {})
            out[name] = {"acked": st.get("batches_acked", 0), "client_rejected": st.get("batches_rejected", {}),
                         "client_quarantined": st.get("batches_quarantined", 0),
                         "client_deferred": st.get("batches_deferred", {}),
                         "coordinator_accepted": coord.get("accepted", 0), "coordinator_rejected": coord.get("rejected", {}),
                         "versions_loaded": len(set(st.get("versions_loaded", [])))}
        return out

    def honest_rejections(self) -> int:
        """Batches of alice's and bob's that were refused for good (deleted or quarantined by the client).
        Not counted: DUPLICATE_BATCH (the repeated ack for a batch already accepted, after a lost ack) and
        the "later" answers (RATE_LIMITED, DEADLINE_EXCEEDED, ...): the client keeps those batches and sends
        them again (`client_deferred` shows how often), so nothing is lost."""
        return sum(n for v in self.honest_view().values()
                   for book in (v["client_rejected"], v["coordinator_rejected"])
                   for code, n in book.items() if code not in NOT_LOST) + \
            sum(v["client_quarantined"] for v in self.honest_view().values())

    def verdict(self, batch_id: bytes, timeout: float = 90.0) -> str:
        """The coordinator's final word on an acked batch: "ACCEPTED", or the code of a train-time reject."""
        hexid = batch_id.hex()

        def final():
            entries = [v for v in self.trust().get("verdicts", []) if v["batch_id"] == hexid]
            for v in entries:
                if v["code"] not in ("ACCEPTED", "AUDIT_PASSED"):
                    return v["code"]
            if any(v["code"] == "AUDIT_PASSED" for v in entries):
                return "ACCEPTED"
            if any(v["code"] == "ACCEPTED" and v.get("audit") in ("skipped", "stale", "passed", "off", "unavailable") for v in entries):
                return "ACCEPTED"
            return None
        return wait_for(final, timeout, f"the coordinator's verdict on batch {hexid[:12]}", interval=0.5)

    def explain(self, batch_id: bytes) -> str:
        """What the coordinator recorded about a batch (for a failing assertion's message): its verdicts,
        the learner's version now and the audit statistics."""
        trust = self.trust()
        entries = [v for v in trust.get("verdicts", []) if v["batch_id"] == batch_id.hex()]
        return f"verdicts={entries} learner_version={self.current_version()} audit={trust.get('audit')}"

    def current_version(self) -> int:
        return max((ev["version"] for ev in read_events(self.run, "publish")), default=0)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.coordinator_pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def acked(self) -> int:
        return sum(self.status(name).get("batches_acked", 0) for name in self.honest)


def sealed_request(swarm: Swarm, ident: Identity, n: int = 0, **fields) -> bytes:
    """A lease request for `n` prompts signed by `ident` for the swarm's coordinator (`fields`: unscorable=...,
    renew=...)."""
    req = messages.LeaseRequest(run_id=RUN_ID, max_prompts=n, adapter_version=0, client_name="mallory", **fields)
    return envelope.seal(ident, "lease_request", messages.encode(req), audience=swarm.coordinator_key)


class Mallory:
    """An attacker with real tools: her own swarm node, the real adapter follower, a real engine."""

    def __init__(self, swarm: Swarm):
        from asyncrl.client.adapter_sync import AdapterSync
        from asyncrl.swarm.transport import SwarmNode

        self.swarm = swarm
        self.node = SwarmNode(initial_peers=[swarm.join])
        self.extra_nodes: list = []
        self.sync = AdapterSync(self.node, coordinator_peer_id=swarm.coordinator_peer,
                                coordinator_key=swarm.coordinator_key, run_id=RUN_ID)
        self.adapters: dict[int, object] = {}  # version -> AdapterVersion (her own archive)
        self._following = False
        self.engine = None
        self.identity = Identity.generate()
        self.coordinator_version = 0  # the learner's version as of her last lease grant
        self.follow_warnings: collections.deque = collections.deque(maxlen=8)  # (time, her follower's warning)

    # ---- tools ----------------------------------------------------------------------------------
    def new_node(self, track: bool = True):
        """A node with a fresh peer id. `track`: shut down when the test ends (the `mallory` fixture); a
        module-scoped fixture passes False and shuts it down itself."""
        from asyncrl.swarm.transport import SwarmNode

        node = SwarmNode(initial_peers=[self.swarm.join])
        if track:
            self.extra_nodes.append(node)
        return node

    def own_node(self, ident: Identity, track: bool = True):
        """A node whose peer id is `ident`'s key, as a real volunteer's is (its requests are its own)."""
        import tempfile

        from asyncrl.swarm.transport import SwarmNode

        path = Path(tempfile.mkdtemp(prefix="peer-", dir=self.swarm.root)) / "p2p.identity"
        ident.write_libp2p_identity(path)
        node = SwarmNode(initial_peers=[self.swarm.join], identity_path=str(path))
        assert node.peer_id == ident.peer_id
        if track:
            self.extra_nodes.append(node)
        return node

    def stall(self, name: str, header_length: int, count: int, node=None, *, drip_bps: int = 0,
              partial_header: bool = False, timeout: float = 60.0) -> list[str]:
        """Open `count` streams at once, each announcing `header_length` bytes and then sending nothing (or
        `drip_bps` bytes a second, or only half a header); the code each got back ("CLOSED" when the server
        hung up without an answer)."""
        from hivemind.p2p import PeerID

        node = node or self.node

        async def one() -> str:
            _, reader, writer = await node.p2p.call_binary_stream_handler(
                PeerID.from_base58(self.swarm.coordinator_peer), stream_name(RUN_ID, name))
            try:
                header = header_length.to_bytes(8, "big")
                writer.write(header[:3] if partial_header else header)
                await writer.drain()
                answer = asyncio.ensure_future(reader.readexactly(1))
                while not answer.done():
                    if drip_bps:
                        try:
                            writer.write(b"x" * drip_bps)
                            await writer.drain()
                        except (ConnectionError, OSError):
                            pass
                    await asyncio.wait([answer], timeout=1.0)
                try:
                    status = answer.result()
                except (asyncio.IncompleteReadError, ConnectionError):
                    return "CLOSED"
                length = int.from_bytes(await reader.readexactly(8), "big")
                body = await reader.readexactly(min(length, 4096))
                return "OK" if status[0] == 0 else body.decode(errors="replace").partition(":")[0]
            except (asyncio.IncompleteReadError, ConnectionError, OSError):
                return "CLOSED"
            finally:
                try:
                    writer.close()
                except Exception:
                    pass

        async def all_of():
            return await asyncio.wait_for(asyncio.gather(*(one() for _ in range(count))), timeout)
        return list(node.loops.run(all_of(), timeout=timeout + 30))

    def follow(self, at_least: int = 0, timeout: float = 120.0):
        """The newest adapter (verified like any volunteer does), loaded into her engine.

        She follows the pointer in the background from her first call on, as a volunteer does: the learner
        publishes about a version a second here, so a follower that fetched only when asked would start each
        fetch far behind, and a chain the coordinator prunes mid-fetch (STALE_VERSION) would make her fetch
        again while the lease she holds runs out."""
        if not self._following:
            self._following = True
            self.sync.start_following(poll_s=0.2, out=lambda m: self.follow_warnings.append((round(time.time(), 1), m)))

        def newest():
            cur = self.sync.current
            return cur if cur is not None and cur.version >= at_least else None
        try:
            current = wait_for(newest, timeout, f"adapter version >= {at_least}", interval=0.2)
        except AssertionError as exc:  # say where her follower stands (CI run t4 of 2026-12-03: no clue left)
            cur = self.sync.current
            raise AssertionError(f"{exc}: she holds v{cur.version if cur else None}, the learner published "
                                 f"v{self.swarm.current_version()}, the DHT gives her pointer "
                                 f"{self._dht_pointer()}, follower alive {self.sync._follower.is_alive()}, "
                                 f"errors {self.sync.errors}, fetch {self.sync.fetcher.stats.as_dict()}, last "
                                 f"warnings {list(self.follow_warnings)} (now {time.time():.1f})") from None
        self.adapters[current.version] = current
        self._engine(current)
        return current

    def _dht_pointer(self) -> str:
        """The pointer version a DHT read returns her now (a diagnostic: stale, absent, or the error)."""
        from asyncrl.protocol import swarm as records

        try:
            raw = self.node.get(records.pointer_key(RUN_ID, self.swarm.coordinator_peer))
            if not isinstance(raw, bytes):
                return f"absent ({type(raw).__name__})"
            pointer, _ = records.check_pointer(raw, coordinator_key=self.swarm.coordinator_key, run_id=RUN_ID)
            return f"v{pointer.version}"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    def _engine(self, adapter):
        if self.engine is None:
            from asyncrl.client.engine import TransformersEngine
            from asyncrl.models import tinymodel

            path = tinymodel.write_tiny_model(tinymodel.default_tiny_model_dir())
            self.engine = TransformersEngine(str(path), adapter.manifest.lora, seed=7)
        if self.engine.version != adapter.version:
            self.engine.load_adapter(adapter.version, adapter.manifest.tensors, adapter.tensors)
        return self.engine

    def call(self, what: str, sealed: bytes, node=None, max_response_bytes: int = 4 << 20) -> bytes:
        return (node or self.node).call(self.swarm.coordinator_peer, stream_name(RUN_ID, what), sealed,
                                        max_response_bytes=max_response_bytes, timeout=60)

    def lease(self, ident: Identity, n: int = 1, node=None, timeout: float = 90.0) -> list[messages.TaskLease]:
        """Lease prompts as `ident`, retrying while the coordinator has no room (or brakes new keys), and
        after a stream that broke without an answer, as the real client's lease loop does (client/worker.py)."""
        from asyncrl.swarm.transport import TransportError

        def attempt():
            try:
                grant = self.lease_once(ident, n, node)
            except TransportError:
                time.sleep(1.0)
                return None
            except ProtocolError as exc:
                if exc.code is RejectCode.RATE_LIMITED:
                    time.sleep(1.0)
                    return None
                raise
            self.coordinator_version = grant.current_version
            return list(grant.leases) or None
        return wait_for(attempt, timeout, "a lease for mallory", interval=0.5)

    @contextlib.contextmanager
    def leased(self, ident: Identity, n: int = 1, node=None):
        """`lease()`, with the leases renewed while the block runs, as a real volunteer's LeaseKeeper does
        while it works (client/lease_keeper.py). An attack judged by the audit must not depend on following,
        loading an engine and generating within one lease timeout (30 s here) on a loaded machine: CI on
        297e41d got UNKNOWN_LEASE instead of LOGPROB_MISMATCH that way. Renewal stops when the block ends
        (leases of a refused batch must not be pinned for the rest of the module)."""
        from asyncrl.client.lease_keeper import LeaseKeeper

        leases = self.lease(ident, n, node)
        with LeaseKeeper(lambda ids: self.renew(ident, ids, node), leases):
            yield leases

    def renew(self, ident: Identity, lease_ids: list[str], node=None) -> dict[str, float]:
        """One renewal-only lease request as `ident`: seconds left per lease id (0 = gone)."""
        return {r.lease_id: r.expires_in_s for r in self.lease_once(ident, 0, node, renew=lease_ids).renewed}

    def lease_once(self, ident: Identity, n: int = 1, node=None, renew=()) -> messages.LeaseGrant:
        req = messages.LeaseRequest(run_id=RUN_ID, max_prompts=n, adapter_version=0, client_name="mallory",
                                    renew=tuple(renew))
        sealed = envelope.seal(ident, "lease_request", messages.encode(req), audience=self.swarm.coordinator_key)
        return messages.decode(self.call("lease", sealed, node), messages.LeaseGrant, max_bytes=4 << 20)

    def generate(self, leases, adapter=None, engine=None) -> list[messages.RolloutGroup]:
        """Honest completions, logprobs and rewards for `leases` under `adapter` (default: her newest)."""
        from asyncrl import tasks

        adapter = adapter or self.sync.current
        engine = engine or self._engine(adapter)
        if engine is not self.engine and engine.version != adapter.version:
            engine.load_adapter(adapter.version, adapter.manifest.tensors, adapter.tensors)
        prompts = [np.frombuffer(l.prompt_token_ids, dtype="<i4").tolist() for l in leases]
        groups = []
        for lease, samples in zip(leases, engine.generate(prompts, leases[0].group_size, leases[0].sampling)):
            comps = []
            for s in samples:
                text = engine.tokenizer.decode(s.token_ids, skip_special_tokens=True)
                comps.append(messages.Completion(token_ids=np.asarray(s.token_ids, dtype="<i4").tobytes(),
                                                 logprobs=np.asarray(s.logprobs, dtype="<f4").tobytes(),
                                                 reward=tasks.score(lease.reward, text, lease.answer),
                                                 finish_reason=s.finish_reason))
            groups.append(messages.RolloutGroup(lease_id=lease.lease_id, prompt_id=lease.prompt_id,
                                                prompt_token_ids=lease.prompt_token_ids, completions=tuple(comps)))
        return groups

    def batch(self, groups, version: int, sampling=None, **overrides) -> messages.RolloutBatch:
        fields = dict(run_id=RUN_ID, adapter_version=version, client_name="mallory",
                      sampling=sampling or messages.SamplingParams(temperature=1.0, max_new_tokens=8),
                      groups=tuple(groups), generated_at=time.time())
        fields.update(overrides)
        return messages.RolloutBatch(**fields)

    def seal(self, ident: Identity, payload: bytes, **kw) -> bytes:
        kw.setdefault("audience", self.swarm.coordinator_key)
        return envelope.seal(ident, "rollout_batch", payload, **kw)

    def submit(self, sealed: bytes, node=None, attempts: int = 3) -> tuple[str, messages.Ack | None]:
        """(code, ack): "ACCEPTED" or the reject code, whether it came in an Ack or as a transport refusal.

        A stream that broke with no answer at all (TransportError: 0 bytes back) is sent again, the same
        bytes, as any client would; each such re-send is listed in `swarm.unanswered` (the table's footer).
        Such a stream is lost below the coordinator's handler (p2pd / the control socket), before the handler
        saw it or after it answered (fresh-clone run r1 of adbd091: a copy was accepted, its answer lost, and
        the re-send came back DUPLICATE_BATCH). A re-send answered DUPLICATE_BATCH with accepted=True is
        therefore the lost ACCEPTED, exactly as the client's outbox reads it (client/delivery.py)."""
        from asyncrl.swarm.transport import TransportError

        for attempt in range(attempts):
            try:
                raw = self.call("submit", sealed, node, max_response_bytes=64 * 1024)
                break
            except ProtocolError as exc:  # refused before ingest (peer banned / rate limited / too large)
                return exc.code.value, None
            except TransportError as exc:
                self.swarm.unanswered.append(f"{time.strftime('%H:%M:%S')} {exc}"[:200])
                if attempt == attempts - 1:
                    raise
                time.sleep(1.0)
        ack = messages.decode(raw, messages.Ack, max_bytes=64 * 1024)
        if attempt and ack.accepted and ack.code == "DUPLICATE_BATCH":
            return "ACCEPTED", ack  # our first send was accepted; its answer was the one lost
        return ("ACCEPTED" if ack.accepted and ack.code is None else ack.code), ack

    def deliver(self, ident: Identity, payload: bytes, node=None, attempts: int = 3) -> tuple[str, int]:
        """An honest volunteer's upload, as the client's outbox does it (client/delivery.py): a stream that
        broke with no answer (TransportError) is sent again, sealed afresh; the batch id is the payload's
        hash, so a copy that did arrive comes back DUPLICATE_BATCH with accepted=True. Returns (the final
        verdict, how many sends broke without an answer) so a row can show them."""
        from asyncrl.swarm.transport import TransportError

        for broke in range(attempts):
            try:
                code, ack = self.submit(self.seal(ident, payload), node, attempts=1)  # this loop re-sends
            except TransportError:
                if broke == attempts - 1:
                    raise
                time.sleep(1.0)
                continue
            if ack is not None and ack.accepted:
                return self.swarm.verdict(ack.batch_id), broke
            return code, broke
        raise AssertionError("unreachable")

    def final_code(self, sealed: bytes, node=None) -> str:
        """Submit, and for an acked batch wait for the coordinator's final verdict (train-time audits)."""
        code, ack = self.submit(sealed, node)
        if code == "ACCEPTED":
            return self.swarm.verdict(ack.batch_id)
        return code

    def raw_stream(self, name: str, header_length: int, body: bytes, node=None, timeout: float = 30.0) -> str:
        """Open a stream, send a frame header announcing `header_length` bytes and read the answer before
        sending any body (so a refusal provably comes before the body is read); then push `body` anyway,
        as an attacker would. Returns the reject code the server answered with."""
        from hivemind.p2p import PeerID

        node = node or self.node

        async def go():
            _, reader, writer = await node.p2p.call_binary_stream_handler(
                PeerID.from_base58(self.swarm.coordinator_peer), stream_name(RUN_ID, name))
            try:
                writer.write(header_length.to_bytes(8, "big"))
                await writer.drain()
                status = await asyncio.wait_for(reader.readexactly(1), timeout)
                length = int.from_bytes(await reader.readexactly(8), "big")
                answer = await reader.readexactly(min(length, 4096))
                try:
                    for i in range(0, len(body), 1 << 20):
                        writer.write(body[i:i + (1 << 20)])
                        await asyncio.wait_for(writer.drain(), 5.0)
                except (ConnectionError, asyncio.TimeoutError, OSError):
                    pass  # the server hung up on us: expected
                return status[0], answer
            finally:
                try:
                    writer.close()
                except Exception:
                    pass
        status, answer = node.loops.run(go(), timeout=timeout + 60)
        assert status == 1, "the oversized request was answered as if it were accepted"
        return answer.decode(errors="replace").partition(":")[0]

    def close_extra_nodes(self, keep: int = 0) -> None:
        """Shut down the extra nodes past the first `keep` (those a test added), each in turn."""
        while len(self.extra_nodes) > keep:
            node = self.extra_nodes.pop()
            try:
                node.shutdown()
            except Exception:
                pass

    def close(self) -> None:
        self.sync.stop()
        self.close_extra_nodes()
        try:
            self.node.shutdown()
        except Exception:
            pass


def batch_id_of(sealed: bytes) -> bytes:
    opened = envelope.open_envelope(sealed, max_bytes=1 << 30, expected_kind="rollout_batch",
                                    expected_audience=None, window_s=None)
    return opened.payload_id


def corrupt(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x01
    return bytes(b)


def replace_completions(groups, fn) -> list[messages.RolloutGroup]:
    """groups with each completion c replaced by fn(c) (a Completion)."""
    return [messages.RolloutGroup(lease_id=g.lease_id, prompt_id=g.prompt_id, prompt_token_ids=g.prompt_token_ids,
                                  completions=tuple(fn(c) for c in g.completions)) for g in groups]


def completion(token_ids, logprobs, reward: float, finish: str = "length") -> messages.Completion:
    return messages.Completion(token_ids=np.asarray(token_ids, dtype="<i4").tobytes(),
                               logprobs=np.asarray(logprobs, dtype="<f4").tobytes(), reward=reward,
                               finish_reason=finish)


@dataclass
class AttackRecord:
    attack: str
    description: str
    tried: int = 0
    rejected: int = 0
    codes: dict = field(default_factory=dict)
    honest_lost: int = 0
    note: str = ""
    honest_extra: int = 0  # honest batches lost outside alice's and bob's books (a test's own honest volunteer)

    def saw(self, code: str, rejected: bool = True) -> None:
        self.tried += 1
        self.rejected += int(rejected)
        self.codes[code] = self.codes.get(code, 0) + 1


class RssSampler:
    """The coordinator's peak RSS during the suite (sampled from /proc every 0.5 s on a daemon thread)."""

    def __init__(self, swarm: Swarm):
        import threading

        self.swarm, self.peak, self.start = swarm, 0, swarm.rss_bytes()
        self._stop = threading.Event()
        threading.Thread(target=self._loop, name="rss-sampler", daemon=True).start()

    def _loop(self) -> None:
        while not self._stop.wait(0.5):
            try:
                self.peak = max(self.peak, self.swarm.rss_bytes())
            except (OSError, AssertionError):
                return

    def stop(self) -> dict:
        self._stop.set()
        return {"coordinator_rss_start": self.start, "coordinator_rss_peak": max(self.peak, self.start)}


def write_artifact(swarm: Swarm, extra: dict, name: str = ARTIFACT.name) -> None:
    """The suite's rows (tests/artifacts/<name>): the shared swarm's, or a module with a swarm of its own."""
    path = ARTIFACT.with_name(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"attacks": [r.__dict__ for r in swarm.results.values()], "written_at": time.time(), **extra}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


__all__ = ["Swarm", "Mallory", "sealed_request", "start_volunteers", "own_rows", "AttackRecord", "RUN_ID", "COORDINATOR_FLAGS", "batch_id_of", "corrupt",
           "replace_completions", "completion", "write_artifact", "wait_for", "fingerprint", "sha"]
