// The status page: everything comes from the admin API of the gateway that served it (no
// build step, nothing from a CDN); what it computes is in console_core.js (ConsoleCore),
// unit-tested. Live state comes from /admin/events (server-sent events, read with fetch:
// EventSource cannot send a key). Where API keys are on, the page (which holds no data)
// loads without one and asks for an admin key, kept in sessionStorage for this tab only.
/* global ConsoleCore */
"use strict";

const C = ConsoleCore;
const $ = (sel) => document.querySelector(sel);
const SVG = "http://www.w3.org/2000/svg";
const queues = {};          // model -> depth, from the event feed
let models = [], engines = [], pulls = [], batches = [], gwStatus = null;
const COLORS = ["#2f6fdb", "#d9822b", "#1a9e77", "#c2418f", "#7d5bd6", "#8c6d1f", "#3aa1b8",
  "#d64545"];
const colorOf = (name, names) => COLORS[Math.max(0, names.indexOf(name)) % COLORS.length];

function cell(text, cls) {
  const td = document.createElement("td");
  td.textContent = text == null ? "–" : String(text);
  if (cls) td.className = cls;
  return td;
}
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.dataset[k.slice(5).replace(/-(.)/g, (m, c) => c.toUpperCase())] = v;
    else node.setAttribute(k, v);
  }
  node.append(...children.filter((c) => c != null));
  return node;
}
function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  node.append(...children.filter((c) => c != null));
  return node;
}
function size(bytes) {
  if (bytes == null) return null;
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (bytes >= 1024 && i < units.length - 1) { bytes /= 1024; i++; }
  return (i ? bytes.toFixed(1) : bytes) + " " + units[i];
}
function duration(s) {
  if (s == null) return null;
  s = Math.round(s);
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
  return Math.floor(s / 3600) + "h" + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + "m";
}
function mib(v) { return v == null ? null : size(v * 1048576); }
function ms(v) {
  return v == null ? null : (v < 1000 ? v.toFixed(1) + " ms" : (v / 1000).toFixed(2) + " s");
}
function clock(ts) { return new Date(ts * 1000).toLocaleTimeString(); }

// an engine's RAM and who measured it (its cgroup or PSS; else systemd's MemoryCurrent),
// and under it what admission counts for it: RAM, and VRAM where there is a GPU
function memoryCell(e) {
  const td = cell(!e ? null : e.ram_bytes != null ? `${size(e.ram_bytes)} (${e.ram_source})`
    : e.memory_bytes != null ? `${size(e.memory_bytes)} (systemd)` : null, "num memory");
  if (e && e.ram_need_mib != null) {
    td.append(el("div", { class: "need" }, `need ${mib(e.ram_need_mib)} RAM`
      + (e.vram_need_mib != null ? `, ${mib(e.vram_need_mib)} VRAM` : "")));
  }
  return td;
}

// --- the admin key and the API --------------------------------------------------------------

const KEY_ITEM = "llm-gateway-admin-key";
function withKey(headers) {
  const key = sessionStorage.getItem(KEY_ITEM);
  return key ? { ...headers, Authorization: `Bearer ${key}` } : { ...headers };
}
function refusedKey(resp, body) {   // keys are on and ours is missing, wrong or not admin
  if (resp.status !== 401 && !(resp.status === 403 && body.error
                               && body.error.code === "scope_not_allowed")) return false;
  $("#key-form").hidden = false;
  $("#live").textContent = "locked"; $("#live").className = "";
  return true;
}
async function api(path, options = {}) {
  const resp = await fetch(path, { ...options, headers: withKey(options.headers) });
  const body = await resp.json();
  if (refusedKey(resp, body)) throw new Error(body.error.message + " (give an admin key)");
  if (!resp.ok) throw new Error((body.error && body.error.message) || resp.statusText);
  return body;
}
$("#key-form").onsubmit = (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY_ITEM, $("#key").value.trim());
  $("#key").value = "";
  $("#key-form").hidden = true;
  $("#error").textContent = "";
  refresh();
  follow();
  refreshCharts().catch(showError);
  loadPlayground();
};

// Read a server-sent event stream (fetch's body) and hand each event's data to onData.
async function readEvents(resp, onData) {
  const reader = resp.body.getReader();
  const text = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    const { events, rest } = C.sseEvents(buffer + text.decode(value, { stream: true }));
    buffer = rest;
    for (const data of events) onData(data);
  }
}

// --- engines, upstreams, downloads, calls ----------------------------------------------------

function renderEngines() {
  const byModel = Object.fromEntries(engines.map((e) => [e.model, e]));
  const ids = [...new Set([...engines.map((e) => e.model), ...models.map((m) => m.id)])];
  const tbody = $("#engines tbody");
  tbody.replaceChildren();
  for (const id of ids) {
    const e = byModel[id];
    const state = e ? e.state : "stopped";
    const tr = el("tr", { "data-model": id });
    tr.append(cell(id));
    const st = cell(state, "state " + state);
    st.dataset.state = state;
    tr.append(st);
    tr.append(cell(e && e.unit), cell(e && e.pid, "num"), cell(duration(e && e.uptime_s), "num"),
      cell(e ? e.restarts : null, "num"), memoryCell(e),
      cell(e ? e.in_flight : null, "num"), cell(queues[id] || 0, "num"));
    const running = e && state !== "stopped";
    const toggle = el("button", {}, running ? "stop" : "start");
    toggle.onclick = () => act(running ? "stop" : "start", id);
    const logs = el("button", {}, "logs");
    logs.onclick = () => { followLogs(id); $("#logs-section-title").scrollIntoView(); };
    tr.append(el("td", {}, toggle, " ", logs));
    tbody.append(tr);
    if (e && e.failure) {
      const td = cell(e.failure.reason || JSON.stringify(e.failure), "reason");
      td.colSpan = 10;
      tbody.append(el("tr", {}, td));
    }
  }
}

async function refreshEngines() {
  const [eng, mod, st] = await Promise.all([
    api("/admin/engines"), api("/admin/models"), api("/admin/status")]);
  engines = eng.engines; models = mod.models; gwStatus = st;
  const facts = [
    `${st.models} models`, `max ${st.max_engines} engines`,
    `systemd: ${st.systemd_manager} manager, ${st.unit_mode} units`,
    `GPU: ${st.gpu}`];
  if (st.gpu_memory_mib) facts.push(
    `GPU memory: ${mib(st.gpu_memory_mib.free)} free of ${mib(st.gpu_memory_mib.total)}`);
  const ram = st.ram_memory_mib;
  if (ram) facts.push(
    `RAM: ${mib(ram.free_for_planning_mib)} free of ${mib(ram.total_mib)} (engines `
    + `${mib(ram.claimed_mib)}, loading ${mib(ram.pending_mib)}, reserve ${mib(ram.reserve_mib)}`
    + (ram.budget_mib != null ? `, budget ${mib(ram.budget_mib)}` : "") + ")");
  if (st.records_dropped) facts.push(`${st.records_dropped} records dropped`);
  if ((st.parked || []).length) facts.push(`parked: ${st.parked.join(", ")}`);
  $("#facts").replaceChildren(...facts.map((f) => el("span", {}, f)));
  renderEngines();
  renderMemory();
  renderUpstreams(st.upstreams || []);
  pulls = st.pulls || [];
  renderPulls();
  // the batches not yet ended, and those that ended since the page last asked (events)
  batches = [...(st.batches || []), ...batches.filter((b) => ENDED.has(b.status)
    && !(st.batches || []).some((x) => x.id === b.id))];
  renderBatches();
  renderLogSources();
}

// downloads (llm-gateway pull): from /admin/status, then each `pull` event as it comes
function renderPulls() {
  $("#pulls-box").hidden = pulls.length === 0;
  $("#pulls tbody").replaceChildren(...pulls.map((p) => {
    const bar = el("progress");
    bar.max = p.total_bytes || 1; bar.value = p.done_bytes;
    const state = p.state + (p.error ? `: ${p.error.message}` : "");
    return el("tr", { "data-pull": p.model }, cell(p.model), cell(p.source),
      cell(state, "state " + (p.state === "done" ? "ready"
        : p.state === "downloading" ? "loading" : "failed")),
      el("td", {}, bar), cell(`${size(p.done_bytes)} / ${size(p.total_bytes)}`, "num"),
      cell(p.rate_bps ? size(p.rate_bps) + "/s" : null, "num"),
      cell(p.eta_s != null ? duration(p.eta_s) : null, "num"));
  }));
}

// batch jobs (OpenAI's Batch API): from /admin/status, then each `batch` event; the rate
// and ETA from the lines done since the page first saw each batch
const ENDED = new Set(["completed", "failed", "expired", "cancelled"]);
const batchSeen = {};       // id -> [seconds, lines done] when first seen
function renderBatches() {
  $("#batches-box").hidden = batches.length === 0;
  const now = Date.now() / 1000;
  $("#batches tbody").replaceChildren(...batches.map((b) => {
    const c = b.request_counts, done = c.completed + c.failed;
    const first = batchSeen[b.id] || (batchSeen[b.id] = [now, done]);
    const rate = now > first[0] + 1 ? (done - first[1]) / (now - first[0]) : 0;
    const bar = el("progress");
    bar.max = c.total || 1; bar.value = done;
    return el("tr", { "data-batch": b.id }, cell(b.id), cell(b.owner || "-"),
      cell(b.endpoint),
      cell(b.status, "state " + (b.status === "completed" ? "ready"
        : ENDED.has(b.status) ? "failed" : "loading")),
      el("td", {}, bar), cell(`${done} / ${c.total}`, "num"), cell(c.failed, "num"),
      cell(rate > 0 ? `${rate.toFixed(1)}/s` : null, "num"),
      cell(rate > 0 && !ENDED.has(b.status) ? duration((c.total - done) / rate) : null,
        "num"));
  }));
}

function renderUpstreams(upstreams) {
  $("#upstreams-box").hidden = upstreams.length === 0;
  $("#upstreams tbody").replaceChildren(...upstreams.map((u) => {
    const inFlight = u.max_concurrency ? `${u.in_flight} / ${u.max_concurrency}` : u.in_flight;
    return el("tr", { "data-upstream": u.name }, cell(u.name),
      cell(u.state, "state " + (u.state === "down" ? "failed" : "ready")),
      cell(u.url), cell(u.models.join(", ")), cell(inFlight, "num"), cell(u.last_error, "reason"));
  }));
}

async function refreshCalls() {
  const { records } = await api("/admin/records?limit=20");
  $("#calls tbody").replaceChildren(...records.map((r) => {
    const tokens = r.prompt_tokens == null && r.completion_tokens == null ? null
      : `${r.prompt_tokens ?? "–"} / ${r.completion_tokens ?? "–"}`;
    const error = C.callError(r);
    const errorCell = cell(error && error.text, "reason");
    if (error && error.title) errorCell.title = error.title;
    return el("tr", {}, cell(clock(r.ts)), cell(r.model),
      cell(r.upstream ? `${r.endpoint} → ${r.upstream}` : r.endpoint),
      cell(r.status, "num"), errorCell, cell(ms(r.latency_ms), "num"),
      cell(ms(r.ttft_ms), "num"), cell(tokens, "num"));
  }));
}

async function act(what, model) {
  $("#error").textContent = "";
  try {
    await api(`/admin/engines/${what}`, { method: "POST",
      headers: { "Content-Type": "application/json" }, body: JSON.stringify({ model }) });
  } catch (err) { $("#error").textContent = `${what} ${model}: ${err.message}`; }
  refresh();
}

// --- memory: per GPU, RAM, and max_engines places -------------------------------------------

function memoryBox(kind, title, detail, bar, names) {
  const segs = bar.parts.filter((p) => p.width > 0 || p.kind === "engine").map((p) => {
    const seg = el("div", { class: `seg ${p.kind}${p.estimated ? " estimated" : ""}`,
      "data-label": p.label, "data-mib": String(Math.round(p.amount)),
      "data-estimated": String(!!p.estimated), title: `${p.label}: ${mib(p.amount)}`
        + (p.estimated ? " (estimate: not measured yet)" : "")
        + (p.need != null && !p.estimated ? `; need ${mib(p.need)}` : "") });
    seg.style.width = p.width + "%";
    if (p.kind === "engine") seg.style.background = colorOf(p.label, names);
    return seg;
  });
  const legend = bar.parts.filter((p) => p.kind !== "free").map((p) => {
    const swatch = el("i");
    swatch.style.background = p.kind === "engine" ? colorOf(p.label, names) : "#8e8e96";
    return el("span", {}, swatch, `${p.label} ${mib(p.amount)}`
      + (p.estimated ? " (est.)" : p.need != null ? ` / need ${mib(p.need)}` : ""));
  });
  return el("div", { class: "membox", "data-memory": kind,
    "data-total-mib": String(Math.round(bar.total)), "data-free-mib": String(Math.round(bar.free)) },
    el("div", { class: "title" }, el("span", {}, title),
      el("span", { class: "hint" }, `${mib(bar.used)} used of ${mib(bar.total)}, `
        + `${mib(bar.free)} free${bar.overfull ? " (over-full: estimates exceed the total)" : ""}`)),
    el("div", { class: "bar" }, ...segs),
    el("div", { class: "bar-legend" }, ...legend,
      detail ? el("span", {}, detail) : null));
}

// an engine's share of a bar: what it holds as measured (MiB), else its need, flagged
function share(e, measuredMib, needMib, split = 1) {
  return { label: e.model, amount: (measuredMib ?? needMib ?? 0) / split,
    estimated: measuredMib == null, need: needMib };
}

function renderMemory() {
  if (!gwStatus) return;
  const names = models.map((m) => m.id);
  const boxes = [];
  for (const d of gwStatus.gpu_devices || []) {
    // an engine over several devices: its per-process VRAM (and need) split evenly
    const holders = engines.filter((e) => (d.engines || []).includes(e.model))
      .map((e) => share(e, e.vram_mib, e.vram_need_mib, Math.max(1, (e.gpus || []).length)));
    boxes.push(memoryBox(`gpu-${d.index}`, `GPU ${d.index}: ${d.name}`, null,
      C.memoryBar(d.total, holders, d.total - d.free), names));
  }
  if (gwStatus.gpu_error) boxes.push(el("p", { class: "reason" }, `GPU: ${gwStatus.gpu_error}`));
  const ram = gwStatus.ram_memory_mib;
  if (ram) {
    const holders = engines.filter((e) => e.holds_place !== false).map((e) => share(
      e, e.ram_bytes != null ? e.ram_bytes / 1048576 : null, e.ram_need_mib));
    boxes.push(memoryBox("ram", "RAM", `free for engines ${mib(ram.free_for_planning_mib)}`
      + ` (reserve ${mib(ram.reserve_mib)}` + (ram.budget_mib != null
        ? `, budget ${mib(ram.budget_mib)}` : "") + ")",
    C.memoryBar(ram.total_mib, holders, ram.total_mib - ram.available_mib), names));
  }
  const placed = engines.filter((e) => e.holds_place);
  const places = [];
  for (let i = 0; i < Math.max(gwStatus.max_engines, placed.length); i++) {
    const e = placed[i];
    const place = el("span", { class: "place" + (e ? "" : " empty"),
      "data-place": e ? e.model : "" }, e ? e.model : "free");
    if (e) place.style.borderColor = colorOf(e.model, names);
    places.push(place);
  }
  boxes.push(el("div", { class: "membox", "data-memory": "places" },
    el("div", { class: "title" }, el("span", {}, "Engine places (max_engines)"),
      el("span", { class: "hint" }, `${placed.length} of ${gwStatus.max_engines} held`)),
    el("div", { class: "places" }, ...places)));
  $("#memory").replaceChildren(...boxes);
}

// --- charts over time (GET /admin/series) ------------------------------------------------------

let series = null;
let chartsAt = 0;           // when the series was last asked for (epoch s)
const CHARTS = [
  { id: "requests", title: "Requests per minute", unit: "/min", perModel: true },
  { id: "latency", title: "Latency p50 / p95", unit: "ms", figures: ["latency_p50", "latency_p95"] },
  { id: "ttft", title: "Time to first token p50 / p95", unit: "ms", figures: ["ttft_p50", "ttft_p95"] },
  { id: "tokens", title: "Generation tokens/s", unit: "tok/s", figures: ["tokens_per_s"] },
  { id: "errors", title: "Errors and rejections", unit: "calls", figures: ["errors", "rejected"] },
];
const NO_MODEL = "(no model)";
const FIGURE_NAMES = { latency_p50: "p50", latency_p95: "p95", ttft_p50: "p50", ttft_p95: "p95",
  tokens_per_s: "tokens/s", errors: "errors", rejected: "rejected (429/503)" };

async function refreshCharts() {
  chartsAt = Date.now() / 1000;
  const window_ = $("#chart-window").value;
  const got = await api(`/admin/series?window=${encodeURIComponent(window_)}`);
  if ($("#chart-window").value !== window_) return;   // another window asked for since
  series = got;
  const select = $("#chart-model");
  const chosen = select.value;
  const names = [...new Set([...series.models, ...models.map((m) => m.id)])];
  select.replaceChildren(el("option", { value: "" }, "all models"),
    ...names.map((n) => el("option", { value: n }, n)));
  select.value = names.includes(chosen) ? chosen : "";
  drawCharts();
  await refreshTimeline();
}

function drawCharts() {
  if (!series) return;
  const model = $("#chart-model").value || undefined;   // undefined: all calls
  const end = series.start + series.buckets * series.step_s;
  const sum = C.summary(series, model);
  $("#chart-summary").replaceChildren(...[
    ["calls", sum.calls], ["errors", sum.errors], ["rejected", sum.rejected],
    ["p50", ms(sum.latency_p50)], ["p95", ms(sum.latency_p95)],
    ["TTFT p50", ms(sum.ttft_p50)],
    ["tokens/s", sum.tokens_per_s == null ? null : sum.tokens_per_s.toFixed(1)],
  ].map(([k, v]) => el("span", { "data-summary": k }, `${k} ${v ?? "–"}`)));
  $("#chart-note").textContent = `buckets of ${duration(series.step_s)}; `
    + "percentiles from histograms (interpolated)";
  const names = [...new Set([...series.models, ...models.map((m) => m.id)])];
  $("#charts").dataset.window = series.window;
  $("#charts").dataset.model = model ?? "";
  $("#charts").replaceChildren(...CHARTS.map((chart) => {
    let lines;
    if (chart.perModel && model === undefined) {
      lines = series.models.map((m) => ({ name: m, color: colorOf(m, names),
        points: C.figureSeries(series, m, "requests") }));
      if (series.series.some((r) => r.model == null)) {   // calls that named no model
        lines.push({ name: NO_MODEL, color: "#8e8e96",
          points: C.figureSeries(series, null, "requests") });
      }
    } else if (chart.perModel) {
      lines = [{ name: model, color: colorOf(model, names),
        points: C.figureSeries(series, model, "requests") }];
    } else {
      lines = chart.figures.map((f, i) => ({ name: FIGURE_NAMES[f], figure: f,
        color: COLORS[i === 0 ? 0 : 7], points: C.figureSeries(series, model, f) }));
    }
    return chartBox(chart, lines, series.start, end);
  }));
}

const CW = 320, CH = 110, LEFT = 34, BOTTOM = 16;
function chartBox(chart, lines, start, end) {
  const { top, lines: drawn } = C.plot(lines.map((l) => l.points), start, end, CW, CH);
  const g = svg("svg", { viewBox: `${-LEFT} -6 ${CW + LEFT + 6} ${CH + BOTTOM + 8}`,
    role: "img", "aria-label": chart.title, "data-chart": chart.id, "data-top": String(top) });
  for (const frac of [0, 0.5, 1]) {
    const y = CH - frac * CH;
    g.append(svg("line", { class: "grid", x1: 0, x2: CW, y1: y, y2: y }),
      svg("text", { x: -4, y: y + 3, "text-anchor": "end" }, axisLabel(top * frac, chart.unit)));
  }
  for (const tick of C.timeTicks(start, end, 4)) {
    const x = (tick.t - start) / Math.max(1, end - start) * CW;
    g.append(svg("text", { x, y: CH + 12, "text-anchor": "middle" }, tick.label));
  }
  drawn.forEach((segments, i) => {
    const line = lines[i];
    for (const seg of segments) {
      if (seg.length > 1) {
        g.append(svg("polyline", { stroke: line.color,
          points: seg.map(([x, y]) => `${x},${y}`).join(" ") }));
      }
      for (const [x, y, value, t] of seg) {
        g.append(svg("circle", { cx: x, cy: y, r: seg.length > 1 ? 1.6 : 2.4, fill: line.color,
          "data-line": line.name, "data-t": String(t), "data-value": String(value) },
        svg("title", {}, `${line.name} ${clock(t)}: ${formatValue(value, chart.unit)}`)));
      }
    }
  });
  const legend = el("div", { class: "legend" }, ...lines.map((l) => {
    const swatch = el("i"); swatch.style.background = l.color;
    return el("span", {}, swatch, l.name);
  }));
  if (!lines.some((l) => l.points.some((p) => p.value != null && p.value !== 0))) {
    legend.append(el("span", {}, "no calls in this window"));
  }
  return el("div", { class: "chart" }, el("h3", {}, chart.title), g, legend);
}
function axisLabel(v, unit) {
  if (unit === "ms") return v >= 1000 ? `${+(v / 1000).toFixed(1)}s` : `${+v.toFixed(0)}ms`;
  return String(+v.toFixed(v < 10 ? 1 : 0));
}
function formatValue(v, unit) {
  return unit === "ms" ? ms(v) : `${+v.toFixed(2)} ${unit}`;
}
$("#chart-window").onchange = () => refreshCharts().catch(showError);
$("#chart-model").onchange = () => { drawCharts(); drawTimeline(); };

// --- the timeline of engine events (GET /admin/events/history, then the live feed) -----------

let eventLog = [];
async function refreshTimeline() {
  if (!series) return;
  try {
    const body = await api(`/admin/events/history?since=${series.start}`);
    eventLog = body.events;
  } catch (err) {
    eventLog = [];
    $("#marks").replaceChildren(el("li", {}, `no history: ${err.message}`));
    return;
  }
  drawTimeline();
}

function drawTimeline() {
  if (!series) return;
  const now = Date.now() / 1000;
  const start = series.start, end = Math.max(now, series.start + series.step_s);
  const seen = new Set(eventLog.filter((e) => e.type === "engine").map((e) => e.model));
  const initial = Object.fromEntries(engines.filter((e) => !seen.has(e.model))
    .map((e) => [e.model, e.state]));
  const { lanes, marks } = C.timeline(eventLog, start, end, initial);
  const model = $("#chart-model").value || null;
  const shown = model ? lanes.filter((l) => l.model === model) : lanes;
  const names = models.map((m) => m.id);
  const lane = 16, width = 640, left = 90;
  const g = svg("svg", { viewBox: `0 0 ${width + left + 24} ${shown.length * lane + 18}`,
    "data-lanes": String(shown.length) });
  const x = (t) => left + (t - start) / Math.max(1, end - start) * width;
  shown.forEach((l, i) => {
    const y = i * lane;
    g.append(svg("text", { x: left - 6, y: y + 11, "text-anchor": "end" }, l.model));
    g.append(svg("line", { class: "grid", x1: left, x2: left + width, y1: y + lane - 1,
      y2: y + lane - 1 }));
    // each run (one load's engine, start to stop) outlined, its spans of states inside; the
    // hover says the run and why it ended, and an eviction is labelled with whom it made
    // room for ("→ chat"; why on hover: "'chat' waited 30 s: max_wait_s")
    const runTitle = (r) => `${clock(r.from)}–${clock(r.to)} ${C.runText(l.model, r)}`;
    for (const r of l.runs) {
      g.append(svg("rect", { x: x(r.from), y: y + 1, width: Math.max(1, x(r.to) - x(r.from)),
        height: lane - 2, rx: 3, fill: "none", stroke: colorOf(l.model, names),
        "stroke-width": 1, "data-run": r.ended ?? "running", "data-model": l.model },
      svg("title", {}, runTitle(r))));
      if (r.ended === "evicted" && r.evicted_for != null) {
        g.append(svg("text", { x: x(r.to) + 3, y: y + 11, class: "swap",
          "data-swap": r.evicted_for, "data-model": l.model }, `→ ${r.evicted_for}`,
        svg("title", {}, runTitle(r))));
      }
    }
    for (const s of l.spans) {
      const color = s.state === "ready" ? colorOf(l.model, names) : "#c9a227";
      const run = l.runs.find((r) => s.from >= r.from && s.to <= r.to);
      g.append(svg("rect", { x: x(s.from), y: y + 3, width: Math.max(1, x(s.to) - x(s.from)),
        height: lane - 6, rx: 2, fill: color, opacity: s.state === "ready" ? 0.85 : 0.6,
        "data-state": s.state, "data-model": l.model },
      svg("title", {}, `${l.model} ${s.state} ${clock(s.from)}–${clock(s.to)}`
        + (run ? `\n${C.runText(l.model, run)}` : ""))));
    }
  });
  const at = Object.fromEntries(shown.map((l, i) => [l.model, i]));
  for (const m of marks) {
    if (!["evicted", "failed", "restarting", "reload", "reload-refused"].includes(m.kind)) continue;
    if (m.model != null && !(m.model in at)) continue;
    const y = m.model == null ? 0 : at[m.model] * lane;
    const h = m.model == null ? shown.length * lane : lane;
    g.append(svg("line", { x1: x(m.ts), x2: x(m.ts), y1: y, y2: y + h,
      stroke: m.kind === "reload" ? "#6b6b70" : "#cf222e", "stroke-width": 2,
      "data-mark": m.kind }, svg("title", {}, `${clock(m.ts)} ${m.text}`)));
  }
  for (const tick of C.timeTicks(start, end, 4)) {
    g.append(svg("text", { x: x(tick.t), y: shown.length * lane + 14, "text-anchor": "middle" },
      tick.label));
  }
  $("#timeline-svg").replaceWith(g);
  g.id = "timeline-svg";
  const listed = marks.filter((m) => !model || m.model === model || m.model == null)
    .slice(-100).reverse();
  $("#marks").replaceChildren(...listed.map((m) => el("li", { class: m.kind,
    "data-kind": m.kind, "data-model": m.model ?? "" }, el("time", {}, clock(m.ts)), m.text)));
  if (!listed.length) $("#marks").append(el("li", {}, "nothing happened in this window"));
}

function keepEvent(event) {
  if (event.type === "queue" || event.type === "snapshot") return;
  if (event.type === "pull" && !["done", "failed", "cancelled"].includes(event.state)) return;
  eventLog = C.keepWindow(eventLog.concat([event]), Date.now() / 1000, 86400, 10000);
  drawTimeline();
}

// --- the playground: chat (streamed), embeddings, transcription ------------------------------

let playModels = [], playing = null;
async function loadPlayground() {
  try {
    const resp = await fetch("/v1/models", { headers: withKey() });
    const body = await resp.json();
    if (!resp.ok) throw new Error((body.error && body.error.message) || resp.statusText);
    playModels = body.data;
  } catch (err) {
    playModels = [];
    $("#play-kind").textContent = `no models for this key: ${err.message}`;
  }
  const select = $("#play-model");
  const chosen = select.value;
  select.replaceChildren(...playModels.map((m) => el("option", { value: m.id }, m.id)));
  if (playModels.some((m) => m.id === chosen)) select.value = chosen;
  playKind();
}
function playModeOf(model) {
  const caps = (model && model.capabilities) || [];
  if (caps.includes("completion")) return "chat";
  if (caps.includes("embeddings")) return "embedding";
  if (caps.includes("transcription")) return "audio";
  return "chat";
}
function playKind() {
  const mode = playModeOf(playModels.find((m) => m.id === $("#play-model").value));
  $("#play-form").dataset.mode = mode;
  for (const node of document.querySelectorAll(".chat-only")) node.hidden = mode !== "chat";
  $("#play-prompt").hidden = mode === "audio";
  $("#play-file").hidden = mode !== "audio";
  if (playModels.length) {
    $("#play-kind").textContent = { chat: "chat, streamed", embedding: "embeddings: the vector's size",
      audio: "transcription of an audio file" }[mode];
  }
}
$("#play-model").onchange = playKind;
$("#play-stop").onclick = () => { if (playing) playing.abort(); };
$("#play-form").onsubmit = async (ev) => {
  ev.preventDefault();
  if (playing) return;
  const model = $("#play-model").value;
  if (!model) return;
  const mode = $("#play-form").dataset.mode;
  playing = new AbortController();
  $("#play-send").disabled = true; $("#play-stop").disabled = false;
  $("#play-out").textContent = ""; $("#play-out").dataset.state = "running";
  $("#play-figures").replaceChildren();
  try {
    if (mode === "embedding") await playEmbedding(model);
    else if (mode === "audio") await playAudio(model);
    else await playChat(model);
    $("#play-out").dataset.state = "done";
  } catch (err) {
    $("#play-out").dataset.state = "error";
    $("#play-out").append(el("span", { class: "reason" },
      `\n${playing.signal.aborted ? "stopped" : err.message}`));
  } finally {
    playing = null;
    $("#play-send").disabled = false; $("#play-stop").disabled = true;
    setTimeout(refreshCalls, 300);
  }
};
async function playPost(path, body, headers) {
  const resp = await fetch(path, { method: "POST", body, signal: playing.signal,
    headers: withKey(headers) });
  if (!resp.ok) {
    const data = await resp.json().catch(() => ({}));
    throw new Error(`${resp.status}: ${(data.error && data.error.message) || resp.statusText}`);
  }
  return resp;
}
function figures(pairs) {
  $("#play-figures").replaceChildren(...pairs.filter(([, v]) => v != null)
    .map(([k, v]) => el("span", { "data-figure": k }, `${k} ${v}`)));
}
async function playChat(model) {
  const t0 = performance.now();
  let first = null, last = null, chunks = 0, usage = null;
  const resp = await playPost("/v1/chat/completions", JSON.stringify({
    model, stream: true, stream_options: { include_usage: true },
    max_tokens: Number($("#play-max").value) || 128,
    temperature: Number($("#play-temp").value),
    messages: [{ role: "user", content: $("#play-prompt").value }],
  }), { "Content-Type": "application/json" });
  const show = () => {
    const f = C.streamFigures(t0, first, last, usage && usage.completion_tokens, chunks);
    figures([["TTFT", ms(f.ttft_ms)], ["tokens", f.tokens],
      ["tokens/s", f.tokens_per_s == null ? null : f.tokens_per_s.toFixed(1)]]);
  };
  await readEvents(resp, (data) => {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
    if (chunk.usage) usage = chunk.usage;
    const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
    const text = delta && (delta.content || delta.reasoning_content);
    if (text) {
      const now = performance.now();
      if (first == null) first = now;
      last = now; chunks++;
      $("#play-out").append(text);
      show();
    }
  });
  show();
}
async function playEmbedding(model) {
  const t0 = performance.now();
  const resp = await playPost("/v1/embeddings", JSON.stringify({ model,
    input: $("#play-prompt").value }), { "Content-Type": "application/json" });
  const body = await resp.json();
  const vector = body.data[0].embedding;
  $("#play-out").textContent = `[${vector.slice(0, 8).map((v) => v.toFixed(4)).join(", ")}`
    + (vector.length > 8 ? ", …]" : "]");
  figures([["dimensions", vector.length], ["time", ms(performance.now() - t0)]]);
}
async function playAudio(model) {
  const file = $("#play-file").files[0];
  if (!file) throw new Error("choose an audio file");
  const form = new FormData();
  form.append("model", model);
  form.append("file", file, file.name);
  const t0 = performance.now();
  const body = await (await playPost("/v1/audio/transcriptions", form)).json();
  $("#play-out").textContent = body.text;
  figures([["time", ms(performance.now() - t0)]]);
}

// --- live logs: follow a journal as it is written ------------------------------------------------

let logFeed = null, logLines = [], logSource = "";   // "": the gateway's own journal
const MAX_LOG_LINES = 2000;
function renderLogSources() {
  const ids = [...new Set([...models.map((m) => m.id), ...engines.map((e) => e.model),
    ...(logSource ? [logSource] : [])])];
  $("#log-source").replaceChildren(el("option", { value: "" }, "the gateway"),
    ...ids.map((id) => el("option", { value: id }, id)));
  $("#log-source").value = logSource;
}
function drawLogLines() {
  const filter = $("#log-filter").value;
  $("#log-lines").textContent = logLines.filter((l) => C.lineMatches(l, filter)).join("\n");
  $("#log-lines").scrollTop = $("#log-lines").scrollHeight;
}
function stopLogs() {
  if (logFeed) logFeed.abort();
  logFeed = null;
  $("#log-follow").textContent = "follow";
}
async function followLogs(model) {
  stopLogs();
  if (model !== undefined) logSource = model;
  renderLogSources();
  const source = logSource;
  const mine = logFeed = new AbortController();
  $("#log-follow").textContent = "stop";
  logLines = [];
  drawLogLines();
  const path = source ? `/admin/engines/logs?model=${encodeURIComponent(source)}&` : "/admin/logs?";
  const what = source || "the gateway";
  $("#log-state").textContent = `following ${what}…`;
  try {
    const resp = await fetch(`${path}follow=1&lines=200`, { headers: withKey(),
      signal: mine.signal });
    if (!resp.ok) {
      const body = await resp.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || resp.statusText);
    }
    $("#log-state").textContent = `following ${what}`;
    $("#log-state").dataset.following = source || "gateway";
    await readEvents(resp, (data) => {
      const event = JSON.parse(data);
      if (event.line == null) return;
      logLines = C.appendBounded(logLines, [event.line], MAX_LOG_LINES);
      drawLogLines();
    });
    $("#log-state").textContent = `${what}: the journal's follow ended`;
  } catch (err) {
    if (!mine.signal.aborted) $("#log-state").textContent = `${what}: ${err.message}`;
  } finally {
    delete $("#log-state").dataset.following;
    if (logFeed === mine) stopLogs();
  }
}
$("#log-follow").onclick = () => (logFeed ? stopLogs() : followLogs());
$("#log-source").onchange = () => {
  logSource = $("#log-source").value;
  if (logFeed) followLogs();
};
$("#log-filter").oninput = drawLogLines;

// --- refresh and the live feed --------------------------------------------------------------------

function showError(err) { $("#error").textContent = err.message; }
let pending = null;
function refresh() {            // coalesce bursts of events into one reload
  if (pending) return;
  pending = setTimeout(async () => {
    pending = null;
    try { await Promise.all([refreshEngines(), refreshCalls()]); } catch (err) { showError(err); }
  }, 100);
}

let feed = null;           // the AbortController of the event feed being read
async function follow() {
  if (feed) feed.abort();
  const mine = feed = new AbortController();
  while (!mine.signal.aborted) {
    try {
      const resp = await fetch("/admin/events", { headers: withKey(), signal: mine.signal });
      if (!resp.ok) {
        if (refusedKey(resp, await resp.json())) return;   // follow() again with a key
        throw new Error(resp.statusText);
      }
      $("#live").textContent = "live"; $("#live").className = "on";
      await readEvents(resp, (data) => onEvent(JSON.parse(data)));
    } catch {
      if (mine.signal.aborted) return;
    }
    $("#live").textContent = "reconnecting…"; $("#live").className = "";
    await new Promise((wake) => setTimeout(wake, 1000));
  }
}

function onEvent(event) {
  keepEvent(event);
  if (event.type === "queue") {
    queues[event.model] = event.depth;
    renderEngines();
  } else if (event.type === "pull") {
    const i = pulls.findIndex((p) => p.model === event.model);
    if (i >= 0) pulls[i] = event; else pulls.unshift(event);
    renderPulls();
    if (event.state === "done") refresh();   // a new model in the catalog
  } else if (event.type === "batch") {
    const i = batches.findIndex((b) => b.id === event.id);
    if (i >= 0) batches[i] = event; else batches.unshift(event);
    renderBatches();
  } else if (event.type === "engine") {
    // show the new state at once, then reload the details
    const e = engines.find((x) => x.model === event.model);
    if (e) e.state = event.state;
    else engines.push({ model: event.model, state: event.state, unit: event.unit });
    renderEngines();
    refresh();
  }
}

refresh();
follow();
refreshCharts().catch(showError);
loadPlayground();
setInterval(refresh, 10000);   // uptimes, memory and the last calls between events
// the charts' data again as often as its buckets fill: a 24 h series costs the gateway
// seconds of CPU on a busy records database (docs/benchmarks.md), a 15 min one little
const CHART_EVERY_S = { "15m": 15, "1h": 30, "24h": 300 };
setInterval(() => {
  const every = CHART_EVERY_S[$("#chart-window").value] || 30;
  if (document.hidden || Date.now() / 1000 - chartsAt < every) return;
  chartsAt = Date.now() / 1000;
  refreshCharts().catch(showError);
}, 5000);
