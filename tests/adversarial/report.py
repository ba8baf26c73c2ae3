"""Render the adversarial suite's results (and the audit calibration) as markdown for docs/SECURITY.md.

    .venv/bin/python -m pytest tests/adversarial          # writes tests/artifacts/adversarial.json (shared swarm)
                                                          # and adversarial_rewards.json (test_rewards.py's own)
    .venv/bin/python bench/audit_calibration.py           # writes runs/bench/audit_calibration.json
    .venv/bin/python -m tests.adversarial.report          # prints the tables
    .venv/bin/python -m tests.adversarial.report --write docs/SECURITY.md   # replaces the marked sections

Sections in the document are delimited by `<!-- adversarial-table:begin/end -->` and
`<!-- audit-calibration:begin/end -->`; everything else in it is left alone.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from tests.adversarial.swarm import ARTIFACT

REPO = Path(__file__).resolve().parents[2]
CALIBRATION = REPO / "runs" / "bench" / "audit_calibration.json"
OWN_ARTIFACTS = {  # modules with a swarm of their own: artifact -> the label of its honest volunteers' line
    ARTIFACT.with_name("adversarial_rewards.json"): "Reward rows (their own swarm, tests/adversarial/test_rewards.py)",
    ARTIFACT.with_name("adversarial_restart.json"): "Restart row (its own swarm, tests/adversarial/test_restart.py)",
}


def attack_table(data: dict, own: list[dict] = ()) -> str:
    """`data`: the shared swarm's artifact; `own`: artifacts of modules with a swarm of their own (their rows
    follow, and their honest volunteers get a line of their own)."""
    rows = [r for d in (data, *own) for r in d["attacks"] if not r["attack"].startswith("_")]
    lines = ["| # | attack | what mallory does | tried | handled | outcome codes | honest batches lost |",
             "|---|---|---|---:|---:|---|---:|"]
    for i, r in enumerate(rows, 1):
        codes = ", ".join(f"`{c}` x{n}" for c, n in sorted(r["codes"].items()))
        desc = r["description"] + (f" ({r['note']})" if r.get("note") else "")
        lines.append(f"| {i} | {r['attack']} | {desc} | {r['tried']} | {r['rejected']} | {codes} | {r['honest_lost']} |")
    start, end = data.get("honest_start", {}), data.get("honest_end", {})
    honest = "; ".join(
        f"{name}: {end[name]['acked']} batches acked ({end[name]['acked'] - start.get(name, {}).get('acked', 0)} "
        f"during the suite), rejected {end[name]['client_rejected'] or '{}'}, quarantined "
        f"{end[name].get('client_quarantined', 0)}, answered \"later\" and re-sent {end[name].get('client_deferred') or '{}'}"
        for name in sorted(end))
    audit = (data.get("trust") or {}).get("audit") or {}
    cost = audit.get("cost_fraction_of_learner")
    tail = ["", f"{len(rows)} attack kinds, {sum(r['tried'] for r in rows)} attempts, "
            f"{sum(r['rejected'] for r in rows)} handled; honest batches lost: "
            f"{sum(r['honest_lost'] for r in rows)}; honest volunteers — {honest}."]
    for d in own:
        end = d.get("honest_end", {})
        tail.append(d.get("label", "Rows of their own swarm") + ": " + "; ".join(
            f"{name}: {end[name]['acked']} batches acked, rejected {end[name]['client_rejected'] or '{}'}"
            for name in sorted(end)) + f"; books {json.dumps({k: v for k, v in (d.get('books') or {}).items() if k in ('unscorable_groups', 'prompts_retired')})}.")
    if "unanswered_streams" in data:
        lost = data["unanswered_streams"]
        tail.append(f"mallory's uploads whose stream broke with no answer and were re-sent (same bytes): {len(lost)}"
                    + (f" ({'; '.join(lost[:3])})" if lost else "") + ".")
    if data.get("coordinator_rss_peak"):
        tail.append(f"Coordinator RSS during the suite: {data['coordinator_rss_start'] / 2**20:.0f} MiB at the start, "
                    f"peak {data['coordinator_rss_peak'] / 2**20:.0f} MiB (sampled every 0.5 s).")
    if audit:
        tail.append(f"Audit during the suite: {audit.get('audited', 0)} batches audited "
                    f"({audit.get('reused_learner_pass', 0)} on the learner's own forward pass, "
                    f"{audit.get('shadow_passes', 0)} shadow-model passes), {audit.get('failed', 0)} failed; "
                    + (f"audit time = {100 * cost:.1f} % of learner time." if cost is not None else ""))
    return "\n".join(lines + tail)


def calibration_section(cal: dict) -> str:
    t, c = cal["totals"], cal["cost"]
    h = cal["honest"]
    fmt = lambda x: f"{x:.2e}"
    lines = [f"Statistic: {cal['statistic']}; tolerance **{cal['tolerance']}** (`--audit-tolerance`). "
             f"Model: {cal['model']}, {cal['versions']} adapter versions, batches of "
             f"{cal['batch']['prompts']} prompts x {cal['batch']['group_size']} completions x "
             f"<= {cal['batch']['max_new_tokens']} tokens.", "",
             "| batches | path | n | min | median | p99 | max | over tolerance |", "|---|---|---:|---:|---:|---:|---:|---:|"]

    def row(name, path, d, key):
        if d:
            lines.append(f"| {name} | {path} | {d['n']} | {fmt(d['min'])} | {fmt(d['p50'])} | {fmt(d['p99'])} | "
                         f"{fmt(d['max'])} | {d[key]} ({100 * d['rate']:.1f} %) |")
    row("honest (fp32 engine, bf16 adapter)", "shadow model", h["shadow"], "rejected")
    row("honest (fp32 engine, bf16 adapter)", "learner's pass", h["learner"], "rejected")
    for path in ("shadow", "learner"):
        for name, d in cal["fabricated"][path].items():
            row(f"fabricated logprobs: {name}", "shadow model" if path == "shadow" else "learner's pass", d, "caught")
    row("hand-picked completions, made-up logprobs", "shadow model", cal["cherry_picked"]["shadow"], "caught")
    row("hand-picked completions, made-up logprobs", "learner's pass", cal["cherry_picked"]["learner"], "caught")
    row("wrong adapter version (1-4 apart)", "shadow model", cal["wrong_version"]["shadow"], "caught")
    row("wrong adapter version (1-4 apart)", "learner's pass", cal["wrong_version"]["learner"], "caught")
    row("another base model", "shadow model", cal["other_base"]["shadow"], "caught")
    probe = cal.get("bf16_volunteer_probe") or {}
    row("probe: honest volunteer running the base in bf16", "shadow model", probe.get("shadow"), "rejected")
    row("probe: honest volunteer running the base in bf16", "learner's pass", probe.get("learner"), "rejected")
    lines += ["", f"**{t['honest_batches']} honest batches ({t['honest_checks']} checks): {t['false_rejects']} false "
                  f"rejects. Caught: {100 * t['fabricated_caught_rate']:.1f} % of {t['fabricated_batches']} "
                  f"fabricated-logprob batches, {100 * t['wrong_version_caught_rate']:.1f} % of "
                  f"{t['wrong_version_batches']} wrong-version batches.** Largest honest value "
                  f"{fmt(t['separation']['honest_max'])}, smallest attack value {fmt(t['separation']['attack_min'])}.",
              "",
              f"Cost (fraction of learner step time, {c['batches_per_step']} batches per step; learner step "
              f"{1000 * c['learner_step_s']:.0f} ms): audit of every batch on the shadow model "
              f"{100 * c['every_batch_on_shadow_fraction']:.0f} % (worst case: every volunteer new and one version "
              f"behind); check on the learner's own pass {100 * c['every_batch_reusing_learner_pass_fraction']:.1f} %; "
              f"trusted volunteers at the {100 * c['trusted_floor_fraction'] / max(1e-9, c['every_batch_on_shadow_fraction']):.0f} % "
              f"floor, shadow path {100 * c['trusted_floor_fraction']:.1f} %."]
    return "\n".join(lines)


def replace_section(text: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- {name}:begin -->\n).*?(\n<!-- {name}:end -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"no <!-- {name}:begin/end --> markers in the document")
    return pattern.sub(lambda m: m.group(1) + body + m.group(2), text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(ARTIFACT))
    ap.add_argument("--calibration", default=str(CALIBRATION))
    ap.add_argument("--write", default=None, help="update the marked sections of this markdown file")
    args = ap.parse_args(argv)
    data = json.loads(Path(args.results).read_text())
    own = [{**json.loads(p.read_text()), "label": label} for p, label in OWN_ARTIFACTS.items() if p.exists()]
    table = attack_table(data, own)
    cal = json.loads(Path(args.calibration).read_text()) if Path(args.calibration).exists() else None
    cal_md = calibration_section(cal) if cal else None
    if args.write:
        path = Path(args.write)
        text = replace_section(path.read_text(), "adversarial-table", table)
        if cal_md:
            text = replace_section(text, "audit-calibration", cal_md)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)
        print(f"updated {path}")
    else:
        print(table)
        if cal_md:
            print()
            print(cal_md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
