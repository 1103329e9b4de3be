// Unit tests of the status page's computations (gatewayd/http/console_core.js), run by
// tests/test_console_js.py with `node --test` (node's own runner: no packages).
"use strict";

const test = require("node:test");
const assert = require("node:assert/strict");
const C = require("../../gatewayd/http/console_core.js");

const BOUNDS = [10, 20, 50, 100];   // 5 bins: <=10, <=20, <=50, <=100, >100

function series(rows, buckets = 4) {
  return { start: 1000, step_s: 60, buckets, latency_bounds_ms: BOUNDS, series: rows };
}
function row(model, bucket, fields) {
  return { model, bucket, calls: 0, errors: 0, rejected: 0, tokens_out: 0, gen_ms: 0,
    latency: [0, 0, 0, 0, 0], ttft: [0, 0, 0, 0, 0], ...fields };
}

test("quantile interpolates inside the bin that holds the rank", () => {
  // 10 values: 4 in (0,10], 4 in (10,20], 2 in (20,50]
  const counts = [4, 4, 2, 0, 0];
  assert.equal(C.quantile(counts, BOUNDS, 0.5), 12.5);   // rank 5: 1 of 4 into (10,20]
  assert.equal(C.quantile(counts, BOUNDS, 0.4), 10);     // rank 4: the top of the first bin
  assert.equal(C.quantile(counts, BOUNDS, 0.95), 42.5);  // rank 9.5: 1.5 of 2 into (20,50]
  assert.equal(C.quantile(counts, BOUNDS, 0.1), 2.5);    // the first bin starts at 0
});

test("quantile of an empty histogram is null; in the open last bin, the last bound", () => {
  assert.equal(C.quantile([0, 0, 0, 0, 0], BOUNDS, 0.5), null);
  assert.equal(C.quantile([0, 0, 0, 1, 9], BOUNDS, 0.95), 100);
  assert.equal(C.quantile([0, 0, 0, 0, 3], BOUNDS, 0.5), 100);
});

test("buckets: one model's rows, or every model's summed (histograms add)", () => {
  const s = series([
    row("a", 0, { calls: 2, latency: [2, 0, 0, 0, 0] }),
    row("b", 0, { calls: 2, latency: [0, 0, 0, 2, 0] }),
    row("a", 3, { calls: 1, errors: 1, latency: [0, 1, 0, 0, 0] }),
    row(null, 1, { calls: 1, rejected: 1, latency: [1, 0, 0, 0, 0] }),
  ]);
  const all = C.bucketsOf(s);
  assert.equal(all.length, 4);
  assert.deepEqual(all.map((b) => b.calls), [4, 1, 0, 1]);
  // null: the calls that named no model (an unknown model's 404, say)
  assert.deepEqual(C.bucketsOf(s, null).map((b) => b.rejected), [0, 1, 0, 0]);
  assert.deepEqual(C.bucketsOf(s, null).map((b) => b.calls), [0, 1, 0, 0]);
  assert.deepEqual(all[0].latency, [2, 0, 0, 2, 0]);
  const a = C.bucketsOf(s, "a");
  assert.deepEqual(a.map((b) => b.calls), [2, 0, 0, 1]);
  assert.equal(a[3].errors, 1);
  // overall p50 of bucket 0: two calls <= 10 and two in (50, 100]: rank 2 is the top of
  // the first bin (an average of the models' p50s would say 40)
  assert.equal(C.quantile(all[0].latency, BOUNDS, 0.5), 10);
});

test("figure series: per minute, percentiles, tokens/s, gaps where there are no calls", () => {
  const s = series([
    row("a", 0, { calls: 3, tokens_out: 100, gen_ms: 2000, latency: [0, 3, 0, 0, 0],
      ttft: [3, 0, 0, 0, 0] }),
    row("a", 2, { calls: 1, errors: 1, latency: [0, 0, 0, 0, 1] }),
  ]);
  const requests = C.figureSeries(s, "a", "requests");
  assert.deepEqual(requests.map((p) => p.t), [1000, 1060, 1120, 1180]);
  assert.deepEqual(requests.map((p) => p.value), [3, 0, 1, 0]);
  assert.deepEqual(C.figureSeries(s, "a", "tokens_per_s").map((p) => p.value), [50, null, null, null]);
  assert.deepEqual(C.figureSeries(s, "a", "latency_p95").map((p) => p.value), [19.5, null, 100, null]);
  assert.deepEqual(C.figureSeries(s, "a", "errors").map((p) => p.value), [0, 0, 1, 0]);
  assert.throws(() => C.figureSeries(s, "a", "nonsense"), /no figure/);
  // 15-second buckets: a call per bucket is 4 per minute
  const quick = { ...series([row("a", 0, { calls: 1 })], 1), step_s: 15 };
  assert.equal(C.figureSeries(quick, "a", "requests")[0].value, 4);
});

test("summary over the window", () => {
  const s = series([
    row("a", 0, { calls: 2, tokens_out: 10, gen_ms: 1000, latency: [2, 0, 0, 0, 0] }),
    row("a", 1, { calls: 2, rejected: 1, tokens_out: 30, gen_ms: 1000, latency: [0, 0, 2, 0, 0] }),
  ]);
  const sum = C.summary(s, "a");
  assert.equal(sum.calls, 4);
  assert.equal(sum.rejected, 1);
  assert.equal(sum.tokens_per_s, 20);
  assert.equal(sum.latency_p50, 10);
  assert.equal(sum.ttft_p50, null);
});

test("niceMax rounds an axis up to 1, 2, 2.5 or 5 times a power of ten", () => {
  assert.equal(C.niceMax(0), 1);
  assert.equal(C.niceMax(7), 10);
  assert.equal(C.niceMax(1.5), 2);
  assert.equal(C.niceMax(2.2), 2.5);
  assert.equal(C.niceMax(40), 50);
  assert.equal(C.niceMax(100), 100);
  assert.equal(C.niceMax(0.03), 0.05);
});

test("plot: x by time, y by value over a round top; a null breaks the line", () => {
  const pts = [{ t: 0, value: 5 }, { t: 50, value: null }, { t: 75, value: 10 }, { t: 100, value: 0 }];
  const { top, lines } = C.plot([pts], 0, 100, 200, 100);
  assert.equal(top, 10);
  assert.equal(lines[0].length, 2);
  assert.deepEqual(lines[0][0], [[0, 50, 5, 0]]);
  assert.deepEqual(lines[0][1], [[150, 0, 10, 75], [200, 100, 0, 100]]);
});

test("memory bar: holders, other, free; an over-full bar is scaled and says so", () => {
  // 350 in use: a's measured 250 and 100 held by something else (b's estimate is no
  // measurement of what is in use)
  const bar = C.memoryBar(1000, [{ label: "a", amount: 250 }, { label: "b", amount: 250,
    estimated: true, need: 300 }], 350);
  assert.deepEqual(bar.parts.map((p) => [p.label, p.width]),
    [["a", 25], ["b", 25], ["other", 10], ["free", 40]]);
  assert.equal(bar.parts[1].estimated, true);
  assert.equal(bar.free, 400);
  const full = C.memoryBar(100, [{ label: "a", amount: 150 }, { label: "b", amount: 50 }], 0);
  assert.equal(full.overfull, true);
  assert.deepEqual(full.parts.map((p) => p.width), [75, 25, 0]);
});

test("timeline: spans per model, evictions with their reason, reloads", () => {
  const ev = [
    { type: "engine", model: "a", state: "starting", from: "stopped", ts: 110 },
    { type: "engine", model: "a", state: "ready", from: "loading", ts: 112, load_s: 2.04 },
    { type: "engine", model: "b", state: "starting", from: "stopped", ts: 150 },
    { type: "engine", model: "a", state: "stopping", from: "ready", ts: 151,
      reason: "evicted for 'b' (idle longest)", evicted_for: "b" },
    { type: "engine", model: "a", state: "stopped", from: "stopping", ts: 152, reason: "evicted" },
    { type: "reload", ok: true, ts: 160 },
    { type: "queue", model: "b", depth: 3, ts: 161 },
    { type: "engine", model: "c", state: "ready", from: "loading", ts: 50 },   // before the window
  ];
  const { lanes, marks } = C.timeline(ev, 100, 200, { d: "ready" });
  assert.deepEqual(lanes.map((l) => l.model), ["a", "b", "d"]);
  const a = lanes[0];
  assert.deepEqual(a.spans, [{ state: "starting", from: 110, to: 112 },
    { state: "ready", from: 112, to: 151 }, { state: "stopping", from: 151, to: 152 }]);
  assert.equal(a.state, "stopped");
  assert.deepEqual(lanes[1].spans, [{ state: "starting", from: 150, to: 200 }]);
  assert.deepEqual(lanes[2].spans, [{ state: "ready", from: 100, to: 200 }]);
  const evicted = marks.find((m) => m.kind === "evicted");
  assert.equal(evicted.text, "a evicted for 'b' (idle longest)");
  assert.equal(marks.find((m) => m.kind === "ready").text, "a ready (loaded in 2.0 s)");
  assert.equal(marks.filter((m) => m.kind === "reload").length, 1);
  assert.equal(marks.length, 5);   // starting a, ready a, starting b, evicted a, reload
});

test("timeline: runs of one engine, start to stop, and why each swap happened", () => {
  const ev = [
    { type: "engine", model: "a", state: "starting", from: "stopped", ts: 110 },
    { type: "engine", model: "a", state: "loading", from: "starting", ts: 111 },
    { type: "engine", model: "a", state: "ready", from: "loading", ts: 112, load_s: 2.04 },
    { type: "engine", model: "a", state: "stopping", from: "ready", ts: 170,
      reason: "evicted for 'b' (max_engines reached; 'a' least recently used)",
      evicted_for: "b", because: "'b' waited 30 s: max_wait_s", rule: "max_wait_s",
      waited_s: 30.1 },
    { type: "engine", model: "a", state: "stopped", from: "stopping", ts: 171,
      reason: "evicted for 'b' (...)", evicted_for: "b", because: "'b' waited 30 s: max_wait_s" },
    { type: "engine", model: "b", state: "starting", from: "stopped", ts: 172 },
    { type: "engine", model: "b", state: "ready", from: "loading", ts: 174, load_s: 1.5 },
    { type: "engine", model: "c", state: "failed", from: "loading", ts: 130, reason: "exit 1" },
    { type: "engine", model: "d", state: "stopping", from: "ready", ts: 150, reason: "requested" },
  ];
  const { lanes, marks } = C.timeline(ev, 100, 200, { c: "starting", d: "ready" });
  const [a, b, c, d] = lanes;
  assert.deepEqual(a.runs, [{ from: 110, ready: 112, load_s: 2.04, to: 170, ended: "evicted",
    why: "evicted for 'b' (max_engines reached; 'a' least recently used)", evicted_for: "b",
    because: "'b' waited 30 s: max_wait_s" }]);   // stopping ends it; stopped adds none
  assert.equal(C.runText("a", a.runs[0]),
    "a ran 60 s (loaded in 2.0 s), evicted for 'b': 'b' waited 30 s: max_wait_s");
  assert.deepEqual(b.runs.map((r) => [r.from, r.ready, r.to, r.ended]), [[172, 174, 200, null]]);
  assert.equal(C.runText("b", b.runs[0]), "b ran 28 s (loaded in 1.5 s), still running");
  // running when the window began (initial): a run from the window's start
  assert.deepEqual(c.runs.map((r) => [r.from, r.to, r.ended]), [[100, 130, "failed"]]);
  assert.equal(C.runText("c", c.runs[0]), "c ran 30 s, failed: exit 1");
  assert.deepEqual(d.runs.map((r) => [r.from, r.ready, r.ended]), [[100, 100, "stopped"]]);
  assert.equal(C.runText("d", d.runs[0]), "d ran 50 s, stopped: requested");
  const evicted = marks.find((m) => m.kind === "evicted");
  assert.equal(evicted.text, "a evicted for 'b' (max_engines reached; 'a' least recently used)"
    + " — 'b' waited 30 s: max_wait_s");
  // an eviction without the words (an older gateway's event): its reason
  const old = C.timeline([ev[0], { ...ev[3], because: undefined }], 100, 200);
  assert.equal(C.runText("a", old.lanes[0].runs[0]),
    "a ran 60 s, evicted for 'b' (max_engines reached; 'a' least recently used)");
});

test("duration: seconds as a person reads them", () => {
  assert.equal(C.duration(0.44), "0.4 s");
  assert.equal(C.duration(42.4), "42 s");
  assert.equal(C.duration(185), "3 min 5 s");
  assert.equal(C.duration(7260), "2 h 1 min");
  assert.equal(C.duration(NaN), "?");
});

test("keepWindow drops what is older than the window, then the oldest past max", () => {
  const ev = [1, 2, 3, 4, 5].map((ts) => ({ ts }));
  assert.deepEqual(C.keepWindow(ev, 5, 2.5, 10).map((e) => e.ts), [3, 4, 5]);
  assert.deepEqual(C.keepWindow(ev, 5, 100, 2).map((e) => e.ts), [4, 5]);
});

test("sseEvents: complete events only, multi-line data joined, CRLF accepted", () => {
  const { events, rest } = C.sseEvents('data: {"a":1}\n\n: keep-alive\n\ndata: x\ndata: y\r\n\r\ndata: par');
  assert.deepEqual(events, ['{"a":1}', "x\ny"]);
  assert.equal(rest, "data: par");
});

test("streamFigures: time to first token and the decode rate after it", () => {
  const f = C.streamFigures(1000, 1250, 3250, 21, 5);
  assert.equal(f.ttft_ms, 250);
  assert.equal(f.tokens, 21);
  assert.equal(f.tokens_per_s, 10);     // 20 tokens after the first in 2 s
  assert.equal(C.streamFigures(0, 100, 300, null, 3).tokens, 3);
  assert.equal(C.streamFigures(0, null, null, null, 0).ttft_ms, null);
});

test("lineMatches: every word, any case; appendBounded keeps the newest", () => {
  assert.equal(C.lineMatches("srv  load_model: loaded", "LOAD srv"), true);
  assert.equal(C.lineMatches("srv  load_model: loaded", "load gpu"), false);
  assert.equal(C.lineMatches("anything", ""), true);
  assert.deepEqual(C.appendBounded([1, 2, 3], [4, 5], 3), [3, 4, 5]);
});

test("callError: whose the error was, then its code; none for a call without one", () => {
  const engine = C.callError({ status: 400, error_source: "engine",
    error_code: "exceed_context_size_error" });
  assert.equal(engine.text, "engine: exceed_context_size_error");
  assert.match(engine.title, /engine's own error answer, relayed/);
  assert.equal(C.callError({ status: 503, error_source: "gateway", error_code: "queue_full" })
    .text, "gateway: queue_full");
  assert.equal(C.callError({ status: 500, error_source: "upstream", error_code: null }).text,
    "upstream");
  // a record from before the column (no error_source) still shows its code
  assert.deepEqual(C.callError({ status: 200, error_code: "client_stalled" }),
    { text: "client_stalled", title: "" });
  assert.equal(C.callError({ status: 200, error_source: null, error_code: null }), null);
});
