"""The volunteer's receipt ledger, `status`, `receipts --export` and offline `verify` (no network)."""

from __future__ import annotations

import base64
import json

from asyncrl.client import cli
from asyncrl.client.ledger import ReceiptLedger
from asyncrl.protocol import receipts
from asyncrl.protocol.identity import Identity, fingerprint
from tests.protocol.test_receipts import BOB, COORD, MALLORY, receipt


def volunteer_dir(tmp_path, n=3):
    data = tmp_path / "alice"
    data.mkdir()
    alice = Identity.from_seed(bytes(range(1, 33)))
    alice.save(data / "identity.key")
    ledger = ReceiptLedger(data)
    sealed = [receipts.seal_receipt(COORD, receipt(i)) for i in range(1, n + 1)]
    assert all(ledger.append(r) for r in sealed)
    assert not ReceiptLedger(data).append(sealed[0])  # the same receipt again (a re-sent batch): kept once
    return data, alice


def address(identity) -> str:
    return f"/ip4/127.0.0.1/tcp/31337/p2p/{identity.peer_id}"


def run(capsys, *argv) -> tuple[int, dict]:
    code = cli.main(list(argv))
    return code, json.loads(capsys.readouterr().out)


def test_export_verifies_offline_against_the_join_address(tmp_path, capsys):
    data, alice = volunteer_dir(tmp_path)
    out = tmp_path / "mine.json"
    code, exported = run(capsys, "receipts", "--data-dir", str(data), "--export", str(out))
    assert code == 0 and exported["exported"] == 3 and exported["coordinator"] == COORD.peer_id
    code, result = run(capsys, "verify", str(out), "--address", address(COORD),
                       "--volunteer", fingerprint(alice.public_key))
    assert code == 0 and result["verified"]
    [totals] = result["runs"]
    assert (totals["batches"], totals["tokens"], totals["volunteer"]) == (3, 30, fingerprint(alice.public_key))


def test_tampered_and_foreign_receipts_fail_verification(tmp_path, capsys):
    data, _ = volunteer_dir(tmp_path)
    out = tmp_path / "mine.json"
    assert cli.main(["receipts", "--data-dir", str(data), "--export", str(out)]) == 0
    capsys.readouterr()
    doc = json.loads(out.read_text())

    tampered = dict(doc, receipts=list(doc["receipts"]))
    raw = bytearray(base64.b64decode(tampered["receipts"][2]))
    raw[-5] ^= 0x40
    tampered["receipts"][2] = base64.b64encode(bytes(raw)).decode()
    (tmp_path / "tampered.json").write_text(json.dumps(tampered))
    code, result = run(capsys, "verify", str(tmp_path / "tampered.json"), "--address", address(COORD))
    assert (code, result["code"], result["index"]) == (1, "SIGNATURE_MISMATCH", 2)

    foreign = dict(doc, receipts=doc["receipts"] + [
        base64.b64encode(receipts.seal_receipt(MALLORY, receipt(4))).decode()])
    (tmp_path / "foreign.json").write_text(json.dumps(foreign))
    code, result = run(capsys, "verify", str(tmp_path / "foreign.json"), "--address", address(COORD))
    assert (code, result["code"], result["index"]) == (1, "NOT_ALLOWED", 3)

    code, result = run(capsys, "verify", str(out), "--address", address(MALLORY))  # checked against another key
    assert (code, result["code"], result["index"]) == (1, "NOT_ALLOWED", 0)

    (tmp_path / "junk.json").write_text("[1, 2]")
    assert cli.main(["verify", str(tmp_path / "junk.json"), "--address", address(COORD)]) == 2


def test_status_shows_verified_totals_and_sets_bad_receipts_apart(tmp_path, capsys):
    data, _ = volunteer_dir(tmp_path)
    ledger = ReceiptLedger(data)
    ledger.append(receipts.seal_receipt(COORD, receipt(7, who=BOB)))  # the coordinator's, but for bob
    forged = bytearray(receipts.seal_receipt(COORD, receipt(8)))
    forged[-2] ^= 1
    ledger.append(bytes(forged))  # altered after signing
    ledger.append(receipts.seal_receipt(MALLORY, receipt(9)))  # another coordinator's: its own group
    code, status = run(capsys, "status", "--data-dir", str(data))
    assert code == 0
    by_peer = {c["coordinator_peer_id"]: c for c in status["receipts"]}
    good = by_peer[COORD.peer_id]
    assert good["verified_receipts"] == 3 and good["runs"]["r"]["batches"] == 3 and good["runs"]["r"]["tokens"] == 30
    assert good["invalid"] == {"WRONG_AUDIENCE": 1, "SIGNATURE_MISMATCH": 1}
    assert by_peer[MALLORY.peer_id]["verified_receipts"] == 1
