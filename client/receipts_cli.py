"""`asyncrl-client receipts` and `asyncrl-client verify`: prove what a volunteer contributed.

    asyncrl-client receipts                                  # verified totals from the local ledger
    asyncrl-client receipts --export mine.json               # every receipt, as signed (portable JSON)
    asyncrl-client verify mine.json --address /ip4/203.0.113.5/tcp/31337/p2p/12D3KooW...

`verify` needs nothing but the file and the join address (the coordinator's key is inside its peer
id): it runs offline, anywhere. Exit codes: 0 every receipt verified · 1 a receipt failed (its index
and reject code are printed: SIGNATURE_MISMATCH = altered, NOT_ALLOWED = signed by another key,
DUPLICATE_BATCH = counted twice, WRONG_AUDIENCE = another volunteer's) · 2 bad arguments or not a
receipts file. Imports neither torch nor hivemind.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


def _err(message: str, code: int) -> int:
    print(f"asyncrl-client: error: {message}", file=sys.stderr)
    return code


def _volunteer_key(data_dir: Path) -> bytes | None:
    from asyncrl.protocol.identity import Identity

    key = data_dir / "identity.key"
    return Identity.load(key).public_key if key.exists() else None


def show_receipts(data_dir: Path, *, export: Path | None, coordinator: str | None) -> int:
    from asyncrl.protocol import receipts
    from asyncrl.protocol.atomic import write_json_atomic
    from asyncrl.protocol.errors import ProtocolError
    from asyncrl.protocol.identity import public_key_from_peer_id

    from .ledger import ReceiptLedger, signer_of, summarise

    own = _volunteer_key(data_dir)
    if own is None:
        return _err(f"no volunteer identity in {data_dir} (has this volunteer joined yet?)", EXIT_INVALID)
    sealed = ReceiptLedger(data_dir).all()
    if coordinator:
        try:
            key = public_key_from_peer_id(coordinator)
        except ProtocolError as exc:
            return _err(f"--coordinator: {exc.detail}", EXIT_USAGE)
        sealed = [r for r in sealed if signer_of(r) == key]
    if export is not None:
        peers = {signer_of(r) for r in sealed}
        only = coordinator or (_peer_id(next(iter(peers))) if len(peers) == 1 else "")
        write_json_atomic(export, receipts.export_document(sealed, coordinator_peer_id=only), indent=1)
        print(json.dumps({"exported": len(sealed), "file": str(export), "coordinator": only}))
        return EXIT_OK
    print(json.dumps({"data_dir": str(data_dir), "coordinators": summarise(sealed, volunteer_key=own)}, indent=2))
    return EXIT_OK


def _peer_id(key: bytes) -> str:
    from asyncrl.protocol.identity import peer_id_from_public_key

    return peer_id_from_public_key(key) if len(key) == 32 else ""


def verify_file(path: Path, *, address: str, coordinator: str | None, volunteer: str | None) -> int:
    from asyncrl.protocol import receipts
    from asyncrl.protocol.errors import ProtocolError
    from asyncrl.swarm.bootstrap import join_spec
    from asyncrl.swarm.transport import BadAddress

    try:
        spec = join_spec(address, coordinator)
    except BadAddress as exc:
        return _err(str(exc), EXIT_USAGE)
    try:
        doc = json.loads(Path(path).read_text())
        sealed = receipts.parse_export(doc)
    except (OSError, ValueError) as exc:
        return _err(f"{path}: {exc.__class__.__name__}: {exc}", EXIT_USAGE)
    except ProtocolError as exc:
        return _err(f"{path}: {exc}", EXIT_USAGE)
    try:
        totals = receipts.verify_receipts(sealed, coordinator_key=spec.coordinator_key)
    except receipts.LedgerError as exc:
        print(json.dumps({"verified": False, "code": exc.code.value, "index": exc.index, "detail": exc.detail}))
        return EXIT_INVALID
    result = {"verified": True, "coordinator_peer_id": spec.coordinator_peer_id, **totals.as_dict()}
    if volunteer and any(run["volunteer"] != volunteer for run in result["runs"]):
        print(json.dumps({"verified": False, "code": "WRONG_AUDIENCE", "index": None,
                          "detail": f"receipts for other volunteers than {volunteer}"}))
        return EXIT_INVALID
    print(json.dumps(result, indent=2))
    return EXIT_OK
