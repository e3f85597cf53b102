// The live status page: polls /debug/status once a second and redraws each engine in place.
// Plain DOM and SVG, no framework, no build step, nothing loaded from elsewhere. Every value from
// the service is written with textContent, never parsed as HTML.
"use strict";

const POLL_MS = 1000;
const CHART_WINDOW_S = 300; // the charts show the last five minutes
const SVG_NS = "http://www.w3.org/2000/svg";

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  for (const child of children) node.append(child);
  return node;
}

function svgEl(tag, attrs = {}) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  return node;
}

const fmt = {
  int: (v) => (v === null || v === undefined ? "–" : Math.round(v).toLocaleString("en-US")),
  pct: (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %"),
  secs: (v) => {
    if (v === null || v === undefined) return "–";
    if (v < 10) return v.toFixed(1) + " s";
    if (v < 120) return Math.round(v) + " s";
    return Math.floor(v / 60) + " min " + Math.round(v % 60) + " s";
  },
  rate: (v) => (v === null || v === undefined ? "–" : v.toFixed(2) + "/s"),
  scale: (v) => (v === null || v === undefined ? "–" : Number.isInteger(v) ? v.toLocaleString("en-US") : v.toFixed(1)),
};

function tile(field, label) {
  return el("div", { class: "tile" },
    el("div", { class: "label" }, label),
    el("div", { class: "value", "data-field": field }, "–"),
    el("div", { class: "sub", "data-field": field + "-sub" }, ""));
}

// Minutes-ago labels under every chart, oldest first.
const TIME_AXIS = [300, 240, 180, 120, 60, 0].map((s) => (s === 0 ? "now" : `${s / 60} min ago`));

function chart(field, label, nSeries) {
  const svg = svgEl("svg", { viewBox: "0 0 300 70", preserveAspectRatio: "none", "data-chart": field });
  for (const y of [2, 35, 68]) svg.append(svgEl("line", { class: "grid", x1: 0, x2: 300, y1: y, y2: y }));
  for (let i = 1; i < 5; i++) svg.append(svgEl("line", { class: "grid", x1: 60 * i, x2: 60 * i, y1: 0, y2: 70 }));
  svg.append(svgEl("line", { class: "limit", x1: 0, x2: 300, y1: -10, y2: -10 }));
  for (let i = 0; i < nSeries; i++) svg.append(svgEl("polyline", { class: "series-" + i, points: "" }));
  const yAxis = el("div", { class: "y-axis", "data-axis": "y" }, el("span", {}, ""), el("span", {}, ""), el("span", {}, ""));
  const xAxis = el("div", { class: "x-axis", "data-axis": "x" }, ...TIME_AXIS.map((t) => el("span", {}, t)));
  return el("div", { class: "chart" },
    el("div", { class: "label" }, el("span", {}, label), el("span", { "data-field": field + "-now" }, "")),
    el("div", { class: "plot" }, yAxis, svg),
    xAxis);
}

function table(field, headers) {
  const head = el("tr");
  for (const [text, num] of headers) head.append(el("th", num ? { class: "num" } : {}, text));
  return el("table", { "data-table": field }, el("thead", {}, head), el("tbody"));
}

function engineSection(name) {
  const section = el("section", { class: "engine", "data-engine": name },
    el("div", { class: "engine-head" },
      el("h2", {}, name),
      el("span", { class: "badge", "data-field": "state" }, "–"),
      el("span", { class: "badge", "data-field": "gate" }, "–"),
      el("span", { class: "models muted", "data-field": "models" }, ""),
      el("span", { class: "url muted", "data-field": "url" }, "")),
    el("p", { class: "banner", "data-field": "banner", hidden: "" }, ""),
    el("div", { class: "tiles" },
      tile("running", "running (engine)"), tile("waiting", "waiting (engine)"),
      tile("kv_usage", "KV cache usage"), tile("snapshot_age", "gauges age"),
      tile("effective_load", "load as the gate sees it"), tile("inflight", "in flight (admitted here)"),
      tile("queue_depth", "parked"), tile("capacity_tokens", "KV capacity (tokens)"),
      tile("reserved_tokens", "KV reserved (tokens)"), tile("available_tokens", "KV free for admission"),
      tile("completion_rate", "completion rate")),
    el("h3", {}, "Last minutes"),
    el("div", { class: "charts" },
      chart("load", "load (running + waiting) and its limit", 1),
      chart("kv", "KV usage and threshold", 1),
      chart("queue", "parked requests", 1),
      chart("decisions", "decisions/s: admitted, rejected", 2)),
    el("h3", {}, "Parked now (FIFO)"),
    table("queue", [["#", true], ["model", false], ["waiting for", true], ["est. tokens", true],
                    ["KV cost", true], ["park cap in", true]]),
    el("h3", {}, "Recent decisions (newest first)"),
    table("recent", [["ago", true], ["model", false], ["outcome", false], ["why", false],
                     ["est. tokens", true], ["waited", true], ["Retry-After", true]]));
  return section;
}

function set(section, field, text, sub) {
  const node = section.querySelector(`[data-field="${field}"]`);
  if (node) node.textContent = text;
  if (sub !== undefined) {
    const subNode = section.querySelector(`[data-field="${field}-sub"]`);
    if (subNode) subNode.textContent = sub;
  }
}

function badge(section, field, text, kind) {
  const node = section.querySelector(`[data-field="${field}"]`);
  node.textContent = text;
  node.className = "badge " + kind;
}

function drawChart(section, field, now, history, series, limit, fixedMax) {
  const svg = section.querySelector(`[data-chart="${field}"]`);
  const points = history.filter((s) => s.t >= now - CHART_WINDOW_S);
  let max = fixedMax || 0;
  if (!fixedMax) {
    for (const s of points) for (const key of series) if (s[key] !== null && s[key] > max) max = s[key];
    if (limit !== null && limit !== undefined && limit > max) max = limit;
    max = Math.max(1, max * 1.15);
  }
  const x = (t) => (300 * (t - (now - CHART_WINDOW_S)) / CHART_WINDOW_S).toFixed(1);
  const y = (v) => (68 - 66 * Math.min(v, max) / max).toFixed(1);
  series.forEach((key, i) => {
    const coords = points.filter((s) => s[key] !== null && s[key] !== undefined).map((s) => `${x(s.t)},${y(s[key])}`);
    svg.querySelector(".series-" + i).setAttribute("points", coords.join(" "));
  });
  const line = svg.querySelector(".limit");
  const ly = limit === null || limit === undefined ? -10 : y(limit);
  line.setAttribute("y1", ly);
  line.setAttribute("y2", ly);
  const last = points.length ? points[points.length - 1] : null;
  const now0 = last && last[series[0]] !== null && last[series[0]] !== undefined ? last[series[0]] : null;
  const scale = field === "kv" ? fmt.pct : field === "decisions" ? fmt.rate : fmt.scale;
  set(section, field + "-now", scale(now0));
  const ticks = svg.parentNode.querySelectorAll('[data-axis="y"] span');
  [max, max / 2, 0].forEach((v, i) => { ticks[i].textContent = scale(v); });
}

function fillTable(section, field, rows, emptyText, cells) {
  const body = section.querySelector(`[data-table="${field}"] tbody`);
  body.replaceChildren();
  if (!rows.length) {
    body.append(el("tr", {}, el("td", { class: "empty", colspan: "7" }, emptyText)));
    return;
  }
  for (const row of rows) {
    const tr = el("tr", { "data-row": field });
    for (const [text, cls] of cells(row)) tr.append(el("td", cls ? { class: cls } : {}, text));
    body.append(tr);
  }
}

function render(doc) {
  const main = document.getElementById("engines");
  const unread = doc.engines.filter((e) => e.health.level === "bad");
  const alerts = document.getElementById("alerts");
  alerts.textContent = unread.map((e) => `${e.name}: ${e.health.headline}`).join(" | ");
  alerts.hidden = unread.length === 0;
  document.getElementById("service").textContent =
    `version ${doc.version}, up ${fmt.secs(doc.uptime_s)}${doc.ready ? "" : ", NOT READY"}`;
  for (const e of doc.engines) {
    let section = main.querySelector(`[data-engine="${CSS.escape(e.name)}"]`);
    if (!section) {
      section = engineSection(e.name);
      main.append(section);
    }
    const health = e.health;
    const level = { ok: "ok", warn: "warn", bad: "bad" }[health.level] || "";
    section.dataset.health = health.status;
    badge(section, "state", e.gated ? `engine state ${e.state}` : "not gated", e.gated ? level : "");
    // An engine whose metrics cannot be read is never shown behind a green gate: failing open is
    // admission switched off, and a gate deciding on an old poll is amber.
    if (health.fail_open) badge(section, "gate", "admission OFF: failing open", "bad");
    else if (e.gate_open) badge(section, "gate", "gate open", level === "ok" || !e.gated ? "ok" : "warn");
    else badge(section, "gate", "gate closed", "warn");
    set(section, "models", e.models.join(", "));
    set(section, "url", `engine ${e.url}, metrics ${e.metrics_url}`);
    const banner = section.querySelector('[data-field="banner"]');
    banner.textContent = health.headline;
    banner.className = "banner " + level;
    banner.hidden = health.status === "ok" || health.status === "not_polled";
    const snap = e.snapshot;
    const lim = e.limits;
    const slots = lim.max_inflight + lim.engine_queue_slots;
    const old = health.status === "ok" || !snap ? "" : `last good poll, ${fmt.secs(snap.age_s)} ago`;
    for (const f of ["running", "waiting", "kv_usage", "effective_load"]) {
      section.querySelector(`[data-field="${f}"]`).parentNode.classList.toggle("unread", health.fail_open);
    }
    set(section, "running", fmt.int(snap && snap.running), old || `max in-flight ${lim.max_inflight}`);
    set(section, "waiting", fmt.int(snap && snap.waiting), old);
    set(section, "kv_usage", fmt.pct(snap && snap.kv_usage), old || `threshold ${fmt.pct(lim.kv_threshold)}`);
    set(section, "snapshot_age", snap ? fmt.secs(snap.age_s) : e.gated ? "never read" : "–",
      health.status === "ok" || !e.gated
        ? `poll every ${lim.poll_interval_s} s, stale after ${lim.stale_after_polls} failures`
        : `${health.status}: ${health.failed_polls} failed polls (${health.reason || "none finished"})`);
    set(section, "effective_load", fmt.int(e.effective_load), `parks at ${slots}`);
    set(section, "inflight", fmt.int(e.inflight), "");
    set(section, "queue_depth", fmt.int(e.queue_depth), `at most ${lim.max_queue_depth}, ${lim.max_park_seconds} s each`);
    set(section, "capacity_tokens", fmt.int(e.capacity_tokens), lim.kv_budget ? "KV budget on" : "KV budget off");
    set(section, "reserved_tokens", fmt.int(e.reserved_tokens), "by open requests admitted here");
    set(section, "available_tokens", fmt.int(e.available_tokens), "");
    set(section, "completion_rate", fmt.rate(e.completion_rate_per_s), `over the last ${e.completion_rate_window_s} s`);

    const h = e.history;
    drawChart(section, "load", doc.now, h, ["load"], slots);
    drawChart(section, "kv", doc.now, h, ["kv_usage"], lim.kv_threshold, 1);
    drawChart(section, "queue", doc.now, h, ["queue"], lim.max_queue_depth);
    drawChart(section, "decisions", doc.now, h, ["admitted_per_s", "rejected_per_s"], null);

    fillTable(section, "queue", e.queue, "nothing parked", (q) => [
      [String(q.position), "num"], [q.model], [fmt.secs(q.age_s), "num"], [fmt.int(q.tokens), "num"],
      [fmt.int(q.cost_tokens), "num"], [fmt.secs(q.expires_in_s), "num"]]);
    fillTable(section, "recent", e.recent, "no decision yet", (d) => [
      [fmt.secs(d.age_s), "num"], [d.model], [d.outcome, "outcome-" + d.outcome], [d.reason],
      [fmt.int(d.tokens), "num"], [fmt.secs(d.waited_s), "num"],
      [d.retry_after === null ? "" : d.retry_after + " s", "num"]]);
  }
}

let lastOk = null;

async function poll() {
  const error = document.getElementById("error");
  try {
    const response = await fetch("/debug/status", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
    lastOk = Date.now();
    error.hidden = true;
  } catch (exc) {
    error.textContent = `cannot read /debug/status: ${exc.message}; showing the last state received`;
    error.hidden = false;
  }
  const fresh = document.getElementById("freshness");
  fresh.textContent = lastOk === null ? "no data" : `live, updated ${new Date(lastOk).toLocaleTimeString()}`;
  fresh.className = "badge " + (lastOk !== null && Date.now() - lastOk < 3 * POLL_MS ? "ok" : "bad");
  fresh.dataset.updated = String(lastOk || "");
  setTimeout(poll, POLL_MS);
}

poll();
