"""The dashboard's one HTML page: inline CSS, a small script, inline-SVG charts. No CDN, no fonts to fetch.

The script polls /api/status every POLL_MS and rebuilds the page's data parts. Every value that came
from a volunteer (names above all) is inserted with textContent / setAttribute, never as HTML, so a
volunteer cannot script the operator's browser. Elements tests rely on: `#swarm tr[data-volunteer]`
rows with `td.lag` / `td.held`, `#contributors tr[data-contributor]`, `#version`, `#updated` (set after each
successful refresh).
"""

POLL_MS = 2000

PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>asyncrl coordinator</title>
<style>
  :root { --fg:#1d2330; --muted:#6b7385; --line:#e3e6ec; --bg:#f6f7f9; --card:#fff;
          --blue:#2f6fdf; --orange:#e07b24; --green:#1f9d55; --red:#c63b3b; }
  * { box-sizing: border-box; }
  body { margin:0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif;
         color:var(--fg); background:var(--bg); }
  header { background:#1d2330; color:#fff; padding:14px 24px; }
  header h1 { margin:0; font-size:18px; font-weight:600; }
  header .sub { color:#b8c0d0; font-size:13px; margin-top:4px; word-break:break-all; }
  header code { color:#fff; background:#2c3446; padding:2px 6px; border-radius:4px; }
  main { padding:18px 24px; max-width:1400px; }
  .cards { display:grid; grid-template-columns:repeat(auto-fill, minmax(150px, 1fr)); gap:12px; }
  .card { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:10px 14px; }
  .card .k { color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:.04em; }
  .card .v { font-size:24px; font-weight:600; margin-top:2px; }
  .card .s { color:var(--muted); font-size:12px; }
  .charts { display:grid; grid-template-columns:repeat(auto-fit, minmax(420px, 1fr)); gap:12px; margin-top:14px; }
  section { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:12px 14px; margin-top:14px; }
  .charts section { margin-top:0; }
  h2 { font-size:14px; margin:0 0 8px; font-weight:600; }
  table { border-collapse:collapse; width:100%; font-variant-numeric:tabular-nums; }
  th, td { text-align:left; padding:6px 10px; border-bottom:1px solid var(--line); white-space:nowrap; }
  th { color:var(--muted); font-weight:500; font-size:12px; text-transform:uppercase; letter-spacing:.03em; }
  td.num, th.num { text-align:right; }
  .mono { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size:12px; }
  .dot { display:inline-block; width:8px; height:8px; border-radius:50%; margin-right:6px; background:var(--muted); }
  .live .dot { background:var(--green); }
  .lag0 { color:var(--green); } .lag1 { color:var(--orange); } .lag2 { color:var(--red); font-weight:600; }
  .rej { color:var(--red); }
  .empty { color:var(--muted); font-style:italic; }
  svg text { fill:var(--muted); font-size:11px; }
  footer { color:var(--muted); font-size:12px; padding:8px 24px 20px; }
  footer a { color:var(--blue); }
  #error { color:var(--red); }
</style>
</head>
<body>
<header>
  <h1>asyncrl coordinator · run <span id="run_id">…</span></h1>
  <div class="sub">model <span id="model">…</span> · coordinator <span id="fingerprint" class="mono">…</span>
    · up <span id="uptime">…</span></div>
  <div class="sub">volunteers join with <code id="join">…</code></div>
</header>
<main>
  <div class="cards">
    <div class="card"><div class="k">Adapter version</div><div class="v" id="version">–</div>
      <div class="s" id="published">not published yet</div></div>
    <div class="card"><div class="k">Optimizer steps</div><div class="v" id="steps">–</div>
      <div class="s" id="steps_sub"></div></div>
    <div class="card"><div class="k">Reward</div><div class="v" id="reward">–</div>
      <div class="s" id="reward_sub"></div></div>
    <div class="card"><div class="k">Staleness</div><div class="v" id="staleness">–</div>
      <div class="s" id="staleness_sub"></div></div>
    <div class="card"><div class="k">Off-policy (ESS)</div><div class="v" id="ess">–</div>
      <div class="s" id="ess_sub"></div></div>
    <div class="card"><div class="k">Throughput</div><div class="v" id="throughput">–</div>
      <div class="s" id="throughput_sub"></div></div>
    <div class="card"><div class="k">Learner idle</div><div class="v" id="capacity">–</div>
      <div class="s" id="capacity_sub"></div></div>
    <div class="card"><div class="k">Volunteers</div><div class="v" id="volunteers">–</div>
      <div class="s" id="volunteers_sub"></div></div>
    <div class="card"><div class="k">Batches</div><div class="v" id="batches">–</div>
      <div class="s" id="batches_sub"></div></div>
    <div class="card"><div class="k">Leases</div><div class="v" id="leases">–</div>
      <div class="s" id="leases_sub"></div></div>
  </div>
  <div class="charts" style="margin-top:14px">
    <section><h2>Reward per optimizer step</h2><svg id="reward_chart" width="100%" height="200"></svg></section>
    <section><h2>Staleness of trained groups (versions behind)</h2>
      <svg id="staleness_chart" width="100%" height="200"></svg></section>
    <section><h2>Off-policy correction: effective sample size (blue), tokens without gradient (red)</h2>
      <svg id="offpolicy_chart" width="100%" height="200"></svg></section>
  </div>
  <section>
    <h2>Swarm</h2>
    <table id="swarm">
      <thead><tr><th>Volunteer</th><th>Fingerprint</th><th class="num">Version held</th><th class="num">Lag</th>
        <th class="num">Rollouts</th><th class="num">Accepted</th><th>Rejected (by code)</th><th>Canary</th><th>Last seen</th></tr></thead>
      <tbody></tbody>
    </table>
  </section>
  <section>
    <h2>Contributors</h2>
    <table id="contributors">
      <thead><tr><th>Volunteer</th><th>Fingerprint</th><th class="num">Accepted batches</th>
        <th class="num">Accepted tokens</th><th class="num">Trained groups</th><th class="num">Share</th></tr></thead>
      <tbody></tbody>
    </table>
  </section>
  <section>
    <h2>Rewards per function (last step)</h2>
    <table id="per_reward">
      <thead><tr><th>Reward</th><th class="num">Mean</th><th class="num">Std</th></tr></thead>
      <tbody></tbody>
    </table>
  </section>
  <section>
    <h2>Sampled completions</h2>
    <table id="completions">
      <thead><tr><th class="num">Step</th><th>Volunteer</th><th>Prompt</th><th>Completion</th>
        <th class="num">Reward</th><th>Per function</th></tr></thead>
      <tbody></tbody>
    </table>
  </section>
  <section>
    <h2>Reward errors reported by volunteers <span id="reward_errors_total"></span></h2>
    <table id="reward_errors">
      <thead><tr><th>Volunteer</th><th>Error</th><th class="num">Leases</th><th>When</th></tr></thead>
      <tbody></tbody>
    </table>
  </section>
  <section>
    <h2>Volunteers refused at the handshake <span id="refusals_total"></span></h2>
    <table id="refusals">
      <thead><tr><th>Volunteer</th><th>Why (and what to install or upgrade)</th><th>When</th></tr></thead>
      <tbody></tbody>
    </table>
  </section>
  <section>
    <h2>Recent adapter versions</h2>
    <table id="publishes">
      <thead><tr><th class="num">Version</th><th>Codec</th><th class="num">Payload</th><th class="num">Raw</th>
        <th class="num">Latency</th><th>Published</th></tr></thead>
      <tbody></tbody>
    </table>
  </section>
</main>
<footer>read-only · refreshed <span id="updated">never</span> <span id="error"></span> ·
  <a href="/api/status">/api/status</a> · <a href="/metrics">/metrics</a> · <a href="/plot.png">/plot.png</a></footer>
<script>
"use strict";
const POLL_MS = __POLL_MS__;
const $ = (id) => document.getElementById(id);
const set = (id, text) => { $(id).textContent = text; };
const fmt = (x, d = 3) => (x === null || x === undefined || Number.isNaN(x)) ? "–" : Number(x).toFixed(d);
function ago(s) {
  if (s === null || s === undefined) return "never";
  if (s < 1) return "just now";
  if (s < 90) return Math.round(s) + " s ago";
  if (s < 5400) return Math.round(s / 60) + " min ago";
  return (s / 3600).toFixed(1) + " h ago";
}
function dur(s) {
  if (s < 90) return Math.round(s) + " s";
  if (s < 5400) return Math.round(s / 60) + " min";
  return (s / 3600).toFixed(1) + " h";
}
function bytes(n) {
  if (n === null || n === undefined) return "–";
  const u = ["B", "KB", "MB", "GB"]; let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return n.toFixed(i ? 1 : 0) + " " + u[i];
}
function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}
function emptyRow(tbody, cols, text) {
  const tr = document.createElement("tr");
  const td = cell(tr, text, "empty"); td.colSpan = cols;
  tbody.appendChild(tr);
}
const SVGNS = "http://www.w3.org/2000/svg";
function svgEl(tag, attrs, text) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
// series: [{ys, color, width, opacity}], xs shared; fixed y range when given
function chart(svg, xs, series, yRange) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = svg.clientWidth || 500, H = svg.clientHeight || 200, L = 40, R = 10, T = 8, B = 22;
  if (!xs.length) { svg.appendChild(svgEl("text", {x: L, y: H / 2}, "no optimizer step yet")); return; }
  let lo = yRange ? yRange[0] : Infinity, hi = yRange ? yRange[1] : -Infinity;
  if (!yRange) for (const s of series) for (const y of s.ys) { lo = Math.min(lo, y); hi = Math.max(hi, y); }
  if (hi - lo < 1e-9) { hi = lo + 1; }
  const x0 = xs[0], x1 = xs[xs.length - 1] === x0 ? x0 + 1 : xs[xs.length - 1];
  const px = (x) => L + (x - x0) / (x1 - x0) * (W - L - R);
  const py = (y) => T + (1 - (y - lo) / (hi - lo)) * (H - T - B);
  for (const f of [0, 0.5, 1]) {
    const y = lo + f * (hi - lo);
    svg.appendChild(svgEl("line", {x1: L, x2: W - R, y1: py(y), y2: py(y), stroke: "#e3e6ec"}));
    svg.appendChild(svgEl("text", {x: L - 6, y: py(y) + 4, "text-anchor": "end"}, y.toFixed(hi - lo >= 10 ? 0 : hi - lo >= 2 ? 1 : 2)));
  }
  svg.appendChild(svgEl("text", {x: L, y: H - 4}, "step " + x0));
  svg.appendChild(svgEl("text", {x: W - R, y: H - 4, "text-anchor": "end"}, "step " + xs[xs.length - 1]));
  for (const s of series) {
    const pts = xs.map((x, i) => px(x).toFixed(1) + "," + py(s.ys[i]).toFixed(1)).join(" ");
    svg.appendChild(svgEl("polyline", {points: pts, fill: "none", stroke: s.color, "stroke-width": s.width || 1.5,
                                       "stroke-opacity": s.opacity || 1}));
  }
}
function render(d) {
  const run = d.run, L = d.learner, st = d.stats, vols = d.volunteers;
  set("run_id", run.run_id); set("model", run.model); set("fingerprint", run.fingerprint);
  set("join", run.join_command || "(starting)"); set("uptime", dur(run.uptime_s));
  set("version", "v" + L.version);
  const pub = st.publishes[0];
  const P = d.publisher || {};
  let ptext = pub ? "v" + pub.version + " published " + ago(d.time - pub.t) : "not published yet";
  if (P.in_flight_s != null && P.in_flight_s > 5) ptext += " · publishing v" + P.in_flight + " for " + dur(P.in_flight_s);
  if (P.queue_depth) ptext += " · 1 waiting";
  if (P.superseded) ptext += " · " + P.superseded + " superseded";
  set("published", ptext);
  set("steps", L.steps);
  const w = L.waiting_for_volunteers;  // --wait-for-volunteers not met yet
  set("steps_sub", w ? "waiting for " + w.joined + "/" + w.needed + " volunteers"
                     : (run.max_steps ? "of " + run.max_steps : "until stopped") +
      (st.last_step ? " · grad norm " + fmt(st.last_step.grad_norm) + " · entropy " + fmt(st.last_step.entropy) +
       " · " + fmt(st.last_step.tokens_per_s, 0) + " tok/s" : ""));
  const last = st.last_step;
  set("reward", last ? fmt(last.reward) : "–");
  set("reward_sub", st.reward_moving_avg === null ? "" : "moving avg (" + st.smooth_window + ") " + fmt(st.reward_moving_avg));
  set("staleness", last ? fmt(last.staleness_mean, 2) : "–");
  set("staleness_sub", "max allowed " + (L.max_staleness === null ? "∞" : L.max_staleness) +
      " · dropped " + st.groups_dropped_stale + " groups");
  set("ess", last && last.ess !== null && last.ess !== undefined ? fmt(last.ess) : "–");
  const gaps = Object.entries(st.off_policy.masked_by_staleness)
      .map(([g, f]) => g + ": " + fmt(100 * f, 0) + "%").join(" · ");
  set("ess_sub", last && last.masked_fraction !== null && last.masked_fraction !== undefined ?
      "masked " + fmt(100 * last.masked_fraction, 1) + "% · E[log²r] " + fmt(last.log_ratio_m2, 3) +
      " · E[r²] " + fmt(last.is_weight_m2, 2) + (gaps ? " · masked by gap (last " +
      st.off_policy.window_steps + " steps) " + gaps : "") : "");
  set("throughput", fmt(st.throughput.rollouts_per_s, 1) + "/s");
  set("throughput_sub", "rollouts · " + fmt(st.throughput.tokens_per_s, 0) + " tokens/s trained · " +
      fmt(st.throughput.steps_per_min, 1) + " steps/min");
  const cap = d.capacity || {};  // coordinator/operator/capacity.py
  set("capacity", cap.learner_idle_fraction === null || cap.learner_idle_fraction === undefined ? "–" :
      fmt(100 * cap.learner_idle_fraction, 0) + "%");
  set("capacity_sub", cap.rollouts_needed_per_s === null || cap.rollouts_needed_per_s === undefined ? "" :
      (cap.keeps_learner_busy ? "the swarm keeps it busy · " : "the swarm does not keep it busy · ") +
      fmt(cap.swarm_rollouts_per_s, 1) + " of " + fmt(cap.rollouts_needed_per_s, 1) + " rollouts/s needed" +
      (cap.more_volunteers_needed ? " · ~" + cap.more_volunteers_needed + " more volunteers of the kinds seen" : ""));
  const live = vols.filter(v => v.live).length;
  set("volunteers", live); set("volunteers_sub", "live of " + vols.length + " seen");
  const acc = vols.reduce((a, v) => a + v.accepted, 0);
  const rej = vols.reduce((a, v) => a + Object.values(v.rejected).reduce((x, y) => x + y, 0), 0);
  set("batches", acc); set("batches_sub", "accepted · " + rej + " rejected");
  set("leases", d.leases.outstanding);
  set("leases_sub", "outstanding · " + d.leases.completed + " done · " + d.leases.expired + " expired");

  const c = st.curves;
  chart($("reward_chart"), c.step, [{ys: c.reward, color: "#2f6fdf", opacity: 0.3, width: 1},
                                    {ys: c.reward_avg, color: "#2f6fdf", width: 2}], [0, 1]);
  chart($("staleness_chart"), c.step, [{ys: c.staleness_max, color: "#e07b24", opacity: 0.3, width: 1},
                                       {ys: c.staleness, color: "#e07b24", width: 2}]);
  chart($("offpolicy_chart"), c.step, [{ys: c.ess, color: "#2f6fdf", width: 2},
                                       {ys: c.masked_fraction, color: "#d62728", width: 2}], [0, 1]);

  const tbody = $("swarm").tBodies[0];
  tbody.replaceChildren();
  if (!vols.length) emptyRow(tbody, 9, "no volunteer has joined yet");
  for (const v of vols) {
    const tr = document.createElement("tr");
    tr.setAttribute("data-volunteer", v.name);
    tr.className = v.live ? "live" : "";
    const name = cell(tr, v.name);
    const dot = document.createElement("span"); dot.className = "dot"; name.prepend(dot);
    cell(tr, v.fingerprint, "mono");
    cell(tr, v.version_held === null ? "–" : "v" + v.version_held, "num held");
    cell(tr, v.lag === null ? "–" : String(v.lag), "num lag " + (v.lag === null ? "" : v.lag === 0 ? "lag0" : v.lag <= 2 ? "lag1" : "lag2"));
    cell(tr, String(v.rollouts), "num");
    cell(tr, String(v.accepted), "num");
    const codes = Object.entries(v.rejected).map(([k, n]) => k + " ×" + n).join(", ");
    cell(tr, codes || "none", codes ? "rej" : "empty");
    cell(tr, v.canary || "–", v.canary && v.canary.includes("FAILED") ? "rej canary" : "canary");
    cell(tr, ago(v.age_s));
    tbody.appendChild(tr);
  }
  const cbody = $("contributors").tBodies[0];
  cbody.replaceChildren();
  if (!d.contributors.length) emptyRow(cbody, 6, "no accepted batch yet");
  for (const c of d.contributors) {
    const tr = document.createElement("tr");
    tr.setAttribute("data-contributor", c.fingerprint);
    cell(tr, c.name); cell(tr, c.fingerprint, "mono");
    cell(tr, String(c.accepted_batches), "num"); cell(tr, String(c.accepted_tokens), "num");
    cell(tr, String(c.trained_groups), "num"); cell(tr, (100 * c.trained_share).toFixed(1) + " %", "num");
    cbody.appendChild(tr);
  }
  const pbody = $("publishes").tBodies[0];
  pbody.replaceChildren();
  if (!st.publishes.length) emptyRow(pbody, 6, "nothing published yet");
  for (const p of st.publishes.slice(0, 8)) {
    const tr = document.createElement("tr");
    cell(tr, "v" + p.version, "num"); cell(tr, p.codec);
    cell(tr, bytes(p.compressed_bytes), "num"); cell(tr, bytes(p.raw_bytes), "num");
    cell(tr, p.latency_s != null ? p.latency_s.toFixed(2) + " s" : "–", "num");
    cell(tr, new Date(p.t * 1000).toLocaleTimeString() + " (" + ago(d.time - p.t) + ")");
    pbody.appendChild(tr);
  }
  const rbody = $("per_reward").tBodies[0];
  rbody.replaceChildren();
  const per = Object.entries(st.per_reward || {});
  if (!per.length) emptyRow(rbody, 3, "no step yet");
  for (const [name, s] of per) {
    const tr = document.createElement("tr");
    tr.setAttribute("data-reward", name);
    cell(tr, name); cell(tr, fmt(s.mean), "num"); cell(tr, fmt(s.std), "num");
    rbody.appendChild(tr);
  }
  const sbody = $("completions").tBodies[0];
  sbody.replaceChildren();
  if (!(d.completions || []).length) emptyRow(sbody, 6, "no sample yet (log_completions_every)");
  for (const c of d.completions || []) {
    const tr = document.createElement("tr");
    cell(tr, String(c.step), "num"); cell(tr, c.client); cell(tr, c.prompt.slice(-200), "mono");
    cell(tr, c.completion.slice(0, 400), "mono"); cell(tr, fmt(c.reward), "num");
    cell(tr, Object.entries(c.rewards).map(([k, v]) => k + " " + fmt(v)).join(", "));
    sbody.appendChild(tr);
  }
  const errs = d.reward_errors || {total: 0, recent: []};
  set("reward_errors_total", errs.total ? "(" + errs.total + ")" : "");
  const ebody = $("reward_errors").tBodies[0];
  ebody.replaceChildren();
  if (!errs.recent.length) emptyRow(ebody, 4, "none");
  for (const e of errs.recent.slice(0, 10)) {
    const tr = document.createElement("tr");
    cell(tr, e.client); cell(tr, e.error, "rej"); cell(tr, String(e.leases), "num"); cell(tr, ago(d.time - e.t));
    ebody.appendChild(tr);
  }
  const refused = d.handshake_refusals || {total: 0, recent: []};
  set("refusals_total", refused.total ? "(" + refused.total + ")" : "");
  const fbody = $("refusals").tBodies[0];
  fbody.replaceChildren();
  if (!refused.recent.length) emptyRow(fbody, 3, "none");
  for (const e of refused.recent.slice(0, 10)) {
    const tr = document.createElement("tr");
    cell(tr, e.client); cell(tr, e.error, "rej"); cell(tr, ago(d.time - e.t));
    fbody.appendChild(tr);
  }
  set("updated", new Date().toLocaleTimeString()); set("error", "");
}
async function refresh() {
  try {
    const r = await fetch("/api/status", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    render(await r.json());
  } catch (e) {
    set("error", "· cannot reach the coordinator (" + e.message + ")");
  }
}
refresh();
setInterval(refresh, POLL_MS);
</script>
</body>
</html>
""".replace("__POLL_MS__", str(POLL_MS))
