// specgate dashboard: polls /dashboard/data and draws every chart from summed counts (ratios derived here).
// window.__dashboard exposes the render state to the browser test (updates, last error, points per chart).
"use strict";

const POLL_MS = 3000;
const WINDOW_BUCKETS_1MIN = 12; // 12 x 5 s buckets
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                 "#bcbd22", "#17becf"];
const charts = {};
const state = { updates: 0, error: null, points: {} };
window.__dashboard = state;

function color(i) { return PALETTE[i % PALETTE.length]; }
function sum(a) { return a.reduce((x, y) => x + y, 0); }
function ratio(num, den) { return den > 0 ? num / den : null; }
function timeLabel(t) { return new Date(t * 1000).toLocaleTimeString([], { hour12: false }); }
function addCols(into, row, fields) {
  for (const f of fields) {
    if (!into[f]) into[f] = row[f].slice();
    else row[f].forEach((v, i) => { into[f][i] += v; });
  }
  return into;
}

// One chart per canvas, created on first use and updated in place after (no flicker, no leak).
function draw(id, type, labels, datasets, options) {
  const points = sum(datasets.map(d => d.data.filter(v => v !== null && v !== undefined).length));
  state.points[id] = points;
  document.getElementById(id).dataset.points = String(points);
  const chart = charts[id];
  if (chart) {
    chart.data.labels = labels;
    chart.data.datasets = datasets;
    chart.update("none");
    return;
  }
  charts[id] = new Chart(document.getElementById(id), {
    type, data: { labels, datasets },
    options: Object.assign({ animation: false, maintainAspectRatio: false, spanGaps: true,
                             interaction: { mode: "index", intersect: false },
                             plugins: { legend: { position: "bottom", labels: { boxWidth: 12 } } },
                             elements: { point: { radius: 0 }, line: { borderWidth: 2 } } }, options || {}),
  });
}

function line(label, data, i, extra) {
  return Object.assign({ label, data, borderColor: color(i), backgroundColor: color(i), tension: 0.2 }, extra || {});
}

function selected(rows, route) { return rows.filter(r => !route || r.route === route); }

function renderAcceptLength(labels, groups, route) {
  const datasets = selected(groups, route).filter(g => sum(g.rounds) > 0).map((g, i) =>
    line(route ? g.slice : g.route + "/" + g.slice, g.rounds.map((r, j) => r > 0 ? 1 + g.accepted[j] / r : null), i));
  draw("chart-accept-length", "line", labels, datasets, { scales: { y: { min: 1, title: { display: true, text: "tokens / round" } } } });
}

function renderPositions(positions, route) {
  const rows = selected(positions, route).filter(p => sum(p.reached) > 0);
  const depth = Math.max(0, ...rows.map(p => p.reached.length));
  const labels = Array.from({ length: depth }, (_, j) => String(j + 1));
  const datasets = rows.map((p, i) => line((route ? "" : p.route + "/") + p.slice + " · " + p.pool,
    labels.map((_, j) => j < p.reached.length && p.reached[j] > 0 ? 100 * p.accepted[j] / p.reached[j] : null), i,
    { elements: { point: { radius: 3 } } }));
  draw("chart-positions", "line", labels, datasets, {
    scales: { x: { title: { display: true, text: "draft position" } },
              y: { min: 0, max: 100, title: { display: true, text: "% accepted | previous accepted" } } } });
}

// Sums over the last `span` buckets at each point (a 5 s bucket holds too few requests for a share).
function rolling(a, span) {
  let acc = 0;
  return a.map((v, i) => { acc += v - (i >= span ? a[i - span] : 0); return acc; });
}

function renderExplorations(labels, groups, route) {
  const bySlice = {};
  for (const g of selected(groups, route)) addCols(bySlice[g.slice] = bySlice[g.slice] || {}, g, ["requests", "explored"]);
  const datasets = Object.keys(bySlice).sort().filter(s => sum(bySlice[s].requests) > 0).map((s, i) => {
    const n = rolling(bySlice[s].requests, WINDOW_BUCKETS_1MIN), e = rolling(bySlice[s].explored, WINDOW_BUCKETS_1MIN);
    return line(s, n.map((v, j) => v > 0 ? 100 * e[j] / v : null), i);
  });
  draw("chart-explore", "line", labels, datasets, { scales: { y: { min: 0, max: 100, title: { display: true, text: "% of requests" } } } });
}

function renderTpot(labels, total) {
  const mean = (s, n) => s.map((v, i) => n[i] > 0 ? 1000 * v / n[i] : null);
  draw("chart-tpot", "line", labels, [
    line("speculative", mean(total.tpot_spec_sum, total.tpot_spec_n), 1),
    line("plain", mean(total.tpot_plain_sum, total.tpot_plain_n), 0),
  ], { scales: { y: { min: 0, title: { display: true, text: "ms / token" } } } });
}

function renderGoodput(labels, total, width) {
  draw("chart-goodput", "line", labels, [
    line("goodput (req/s)", total.slo_met.map(v => v / width), 2, { yAxisID: "y", fill: true, backgroundColor: "#2ca02c33" }),
    line("throughput (req/s)", total.ok.map(v => v / width), 7, { yAxisID: "y", borderDash: [4, 3] }),
    line("attainment (%)", total.slo_met.map((m, i) => { const r = ratio(m, m + total.slo_missed[i]); return r === null ? null : 100 * r; }),
      3, { yAxisID: "y2" }),
  ], { scales: { y: { min: 0, title: { display: true, text: "req/s" } },
                 y2: { min: 0, max: 100, position: "right", grid: { drawOnChartArea: false } } } });
}

function renderRules(labels, rules, route) {
  const byRule = {};
  for (const r of selected(rules, route)) addCols(byRule[r.rule] = byRule[r.rule] || {}, r, ["count"]);
  const datasets = Object.keys(byRule).sort().map((rule, i) =>
    ({ label: rule, data: byRule[rule].count, backgroundColor: color(i), stack: "rules" }));
  draw("chart-rules", "bar", labels, datasets, { scales: { x: { stacked: true }, y: { stacked: true, min: 0 } } });
}

function renderPools(labels, pools) {
  const load = [];
  pools.forEach((p, i) => {
    load.push(line(p.pool + " running", p.running, i));
    load.push(line(p.pool + " waiting", p.waiting, i, { borderDash: [5, 4] }));
  });
  draw("chart-pool-load", "line", labels, load, { scales: { y: { min: 0, title: { display: true, text: "requests" } } } });
  draw("chart-kv", "line", labels, pools.map((p, i) => line(p.pool, p.kv_usage.map(v => v === null ? null : 100 * v), i)),
    { scales: { y: { min: 0, max: 100, title: { display: true, text: "% of KV cache" } } } });
}

function cell(text, cls) { const td = document.createElement("td"); td.textContent = text; if (cls) td.className = cls; return td; }
function fmt(v, digits) { return v === null || v === undefined ? "–" : Number(v).toFixed(digits); }

function renderPoolTable(pools) {
  const table = document.createElement("table");
  const head = table.insertRow();
  for (const h of ["pool / worker", "proposer", "healthy", "running", "waiting", "in flight", "KV %", "accept len", "pair"]) {
    const th = document.createElement("th"); th.textContent = h; head.appendChild(th);
  }
  for (const p of pools) {
    const row = table.insertRow();
    [cell(p.pool), cell(p.proposer), cell(p.healthy_workers + "/" + p.workers, p.healthy_workers > 0 ? "up" : "down"),
     cell(p.running), cell(p.waiting), cell(p.in_flight), cell(p.kv_usage === null ? "–" : fmt(100 * p.kv_usage, 0)),
     cell(fmt(p.accept_length, 2)), cell(p.pair, p.pair === "mismatch" ? "down" : p.pair === "verified" ? "up" : "")]
      .forEach(td => row.appendChild(td));
    for (const w of p.worker_states) {
      const wr = table.insertRow(); wr.className = "worker";
      [cell(w.worker), cell(""), cell(w.healthy ? "up" : "down", w.healthy ? "up" : "down"), cell(w.running ?? "–"),
       cell(w.waiting ?? "–"), cell(""), cell(w.kv_usage === null ? "–" : fmt(100 * w.kv_usage, 0)), cell(""),
       cell(w.mismatches.join("; ") || w.last_error || "")].forEach(td => wr.appendChild(td));
    }
  }
  const box = document.getElementById("pools");
  box.replaceChildren(table);
}

// Speedup table: slice rows x load columns; the gateway sums the window and derives the ratios (route "*": all).
function renderSpeedup(speedup, route) {
  const cells = speedup.cells.filter(c => c.route === (route || "*"));
  const loads = speedup.loads.filter(l => cells.some(c => c.load === l.load));
  const slices = Array.from(new Set(cells.map(c => c.slice))).sort();
  const table = document.createElement("table");
  const head = table.insertRow();
  for (const h of ["slice \\ in flight", ...loads.map(l => l.load)]) {
    const th = document.createElement("th"); th.textContent = h; head.appendChild(th);
  }
  const ms = v => v === null ? "–" : fmt(1000 * v, 1) + " ms";
  for (const slice of slices) {
    const row = table.insertRow();
    row.appendChild(cell(slice));
    for (const l of loads) {
      const c = cells.find(x => x.slice === slice && x.load === l.load);
      // measured against plain requests where the cell has both; else against the worker's plain estimates (≈)
      const ratio = !c ? null : c.speedup !== null ? c.speedup : c.estimated_speedup;
      const td = ratio === null ? cell("–", "none")
        : cell((c.speedup === null ? "≈" : "") + fmt(ratio, 2) + "x (n=" + c.spec_n + "/" + c.plain_n + ")",
               ratio >= 1 ? "up" : "down");
      if (c) td.title = "speculative " + ms(c.spec_tpot_s) + " (" + c.spec_n + " requests), plain " + ms(c.plain_tpot_s) +
        " (" + c.plain_n + " requests)" + (c.estimated_speedup === null ? "" : "; against the worker's plain " +
        "estimate for the same tokens " + fmt(c.estimated_speedup, 2) + "x (" + c.est_n + " requests)");
      row.appendChild(td);
    }
  }
  if (!slices.length) {
    const row = table.insertRow();
    row.appendChild(cell("no request with a TPOT and a load in the window", "none"));
  }
  state.speedup = { rows: slices.length, loads: loads.length, ratios: cells.filter(c => c.speedup !== null).length,
                    estimated: cells.filter(c => c.speedup === null && c.estimated_speedup !== null).length };
  document.getElementById("speedup").replaceChildren(table);
}

// Pair gates: one block per gated pool (state badge, reason, last verdict, ramp regions, last events, newest first).
const GATE_EVENTS_SHOWN = 8;
function el(tag, text, cls) { const e = document.createElement(tag); if (text !== undefined) e.textContent = text; if (cls) e.className = cls; return e; }
function ago(seconds) {
  const s = Math.max(0, seconds);
  return s < 90 ? fmt(s, 0) + " s" : s < 5400 ? fmt(s / 60, 0) + " min" : fmt(s / 3600, 1) + " h";
}
function gateTable(headers, rows) {
  const table = document.createElement("table");
  const head = table.insertRow();
  for (const h of headers) head.appendChild(el("th", h));
  for (const r of rows) { const row = table.insertRow(); r.forEach(td => row.appendChild(td)); }
  return table;
}

function renderEvidence(rows, route) {
  const box = document.getElementById("evidence");
  const shown = selected(rows, route);
  box.replaceChildren(shown.length ? gateTable(["route", "slice", "options taught"],
    shown.map(r => [cell(r.route), cell(r.slice), cell(String(r.options), "num")]))
    : el("p", "none yet (auto rules with fixed n-gram or suffix pools, greedy requests)", "muted"));
}

function verdictText(v) {
  if (!v) return [el("p", "no equivalence run yet", "none")];
  const result = v.error ? "could not run" : v.passed ? "passed" : "failed";
  return [gateTable(["last equivalence run", "canaries", "tokens", "accept len", "sampled p", "seconds", "mismatch"], [[
    cell(result, v.error ? "" : v.passed ? "up" : "down"), cell(v.canaries), cell(v.tokens), cell(fmt(v.accept_length, 2)),
    cell(v.sampled_p === null ? "–" : Number(v.sampled_p).toPrecision(2)), cell(fmt(v.seconds, 1)),
    cell(v.mismatch || "–")]])];
}

function renderGates(gates, now) {
  const box = document.getElementById("gates");
  state.gates = {};
  if (!gates.length) { box.replaceChildren(el("p", "no pair gates (the policy has no gates: section, or no pool has a pair)", "none")); return; }
  const blocks = gates.map(g => {
    state.gates[g.pool] = { state: g.state, regions: g.regions.length, events: g.history.length };
    const block = el("div", undefined, "gate");
    block.dataset.pool = g.pool;
    const title = el("h3");
    title.append(el("span", g.pool), el("span", g.state, "badge " + g.state));
    if (g.running) title.append(el("span", "equivalence run in flight", "badge"));
    title.append(el("span", "since " + timeLabel(g.since) + " (" + ago(now - g.since) + " ago) · version " + (g.key || "unknown") +
      (g.collapses ? " · " + g.collapses + " collapse" + (g.collapses > 1 ? "s" : "") : ""), "muted"));
    block.append(title, el("p", g.reason), ...verdictText(g.verdict));
    block.append(el("h4", "serving ramp"));
    block.append(g.regions.length ? gateTable(["slice", "in flight", "share", "window (spec / plain)", "windows", "last window"],
      g.regions.map(r => [cell(r.slice), cell(r.load), cell(r.closed_for_s === null ? fmt(100 * r.share, 0) + " %"
        : "closed (" + ago(r.closed_for_s) + " left)", r.share >= 1 ? "up" : r.share === 0 ? "down" : ""),
        cell(r.window_speculative + " / " + r.window_plain), cell(r.steps), cell(r.last || "–")]))
      : el("p", "no load region ramping", "none"));
    block.append(el("h4", "last events"));
    block.append(gateTable(["at", "gate", "state", "reason"], g.history.slice(-GATE_EVENTS_SHOWN).reverse().map(e => [
      cell(timeLabel(e.at)), cell(e.gate), cell((e.previous ? e.previous + " → " : "") + e.state,
        e.state === "failed" || e.state === "degraded" ? "down" : e.state === "passed" ? "up" : ""), cell(e.reason)])));
    return block;
  });
  box.replaceChildren(...blocks);
}

function renderTiles(total, width) {
  const last = a => sum(a.slice(-WINDOW_BUCKETS_1MIN));
  const span = Math.min(WINDOW_BUCKETS_1MIN, total.requests.length) * width;
  const met = last(total.slo_met), missed = last(total.slo_missed);
  document.getElementById("tile-rps").textContent = fmt(last(total.requests) / span, 2);
  document.getElementById("tile-goodput").textContent = fmt(met / span, 2);
  const att = ratio(met, met + missed);
  document.getElementById("tile-attainment").textContent = att === null ? "–" : fmt(100 * att, 1) + " %";
  const rounds = last(total.rounds);
  document.getElementById("tile-accept").textContent = rounds > 0 ? fmt(1 + last(total.accepted) / rounds, 2) : "–";
  document.getElementById("tile-errors").textContent = String(last(total.errors));
  document.getElementById("tile-resumed").textContent = String(last(total.resumed));
}

function renderHeader(data) {
  const p = data.policy;
  document.getElementById("policy").textContent = "policy " + p.version;
  const reload = document.getElementById("reload");
  reload.textContent = p.reload_ok ? "last reload ok" : "last reload FAILED: " + (p.error || "");
  reload.className = "badge " + (p.reload_ok ? "ok" : "bad");
  const select = document.getElementById("route");
  const have = Array.from(select.options).map(o => o.value);
  for (const r of p.routes) if (!have.includes(r)) select.add(new Option(r, r));
  document.getElementById("updated").textContent = "updated " + timeLabel(data.now);
}

function render(data) {
  const route = document.getElementById("route").value;
  const s = data.series;
  const labels = s.t.map(timeLabel);
  const n = s.t.length;
  const fields = Object.keys(s.groups[0] || {}).filter(k => Array.isArray(s.groups[0][k]));
  const zero = {};
  for (const f of ["requests", "ok", "errors", "resumed", "slo_met", "slo_missed", "rounds", "accepted", "tpot_spec_sum",
                   "tpot_spec_n", "tpot_plain_sum", "tpot_plain_n"]) zero[f] = new Array(n).fill(0);
  const total = selected(s.groups, route).reduce((acc, g) => addCols(acc, g, fields), zero);
  renderHeader(data);
  renderTiles(total, s.width_s);
  renderAcceptLength(labels, s.groups, route);
  renderPositions(data.positions, route);
  renderTpot(labels, total);
  renderSpeedup(data.speedup, route);
  renderGoodput(labels, total, s.width_s);
  renderExplorations(labels, s.groups, route);
  renderRules(labels, s.rules, route);
  renderPools(labels, s.pools);
  renderPoolTable(data.pools);
  renderGates(data.gates || [], data.now);
  renderEvidence(data.evidence || [], route);
}

let latest = null;
async function poll() {
  try {
    const response = await fetch("/dashboard/data", { cache: "no-store" });
    if (!response.ok) throw new Error("GET /dashboard/data: HTTP " + response.status);
    latest = await response.json();
    render(latest);
    state.updates += 1;
    state.error = null;
    document.getElementById("error").hidden = true;
  } catch (err) {
    state.error = String(err);
    console.error("dashboard:", err);
    const box = document.getElementById("error");
    box.textContent = "dashboard data unavailable: " + err;
    box.hidden = false;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

document.getElementById("route").addEventListener("change", () => { if (latest) render(latest); });
poll();
