// The status page's computations, with no DOM: time buckets, percentiles, chart scales,
// memory bars, the engine timeline, server-sent events and stream figures. The page
// (console_page.js) draws what these return; tests/js/ runs them under node --test.
// The gateway inlines this file into the page (no build step, nothing from a CDN).
"use strict";

const ConsoleCore = (() => {
  // --- the call-record series (GET /admin/series) ---------------------------------------

  // One time bucket of calls: counts, generation figures and the latency and time-to-first-
  // token histograms (bins of bounds: counts[i] holds values <= bounds[i] and > bounds[i-1];
  // the last bin holds those above the last bound).
  function emptyBucket(bins) {
    return { calls: 0, errors: 0, rejected: 0, tokens_out: 0, gen_ms: 0,
      latency: new Array(bins).fill(0), ttft: new Array(bins).fill(0) };
  }

  function addInto(into, row) {
    into.calls += row.calls;
    into.errors += row.errors;
    into.rejected += row.rejected;
    into.tokens_out += row.tokens_out;
    into.gen_ms += row.gen_ms;
    for (let i = 0; i < into.latency.length; i++) {
      into.latency[i] += row.latency[i] || 0;
      into.ttft[i] += row.ttft[i] || 0;
    }
  }

  // The series' rows as one bucket per step: one model's (model given; null: the calls
  // that named no model, e.g. an unknown one's 404) or all calls summed (model undefined:
  // histograms add, so the overall percentiles are of all calls, not an average of the
  // models' percentiles).
  function bucketsOf(series, model) {
    const bins = series.latency_bounds_ms.length + 1;
    const out = Array.from({ length: series.buckets }, () => emptyBucket(bins));
    for (const row of series.series) {
      if (model !== undefined && row.model !== model) continue;
      if (row.bucket < 0 || row.bucket >= series.buckets) continue;
      addInto(out[row.bucket], row);
    }
    return out;
  }

  // The q-quantile (0..1) of a histogram, interpolated linearly inside its bin (as
  // Prometheus' histogram_quantile does: the first bin starts at 0; a quantile in the last,
  // unbounded bin is the last bound). null for an empty histogram.
  function quantile(counts, bounds, q) {
    const total = counts.reduce((a, b) => a + b, 0);
    if (!total) return null;
    const rank = q * total;
    let seen = 0;
    for (let i = 0; i < counts.length; i++) {
      if (!counts[i]) continue;
      if (seen + counts[i] >= rank) {
        if (i >= bounds.length) return bounds[bounds.length - 1];
        const lower = i === 0 ? 0 : bounds[i - 1];
        return lower + (bounds[i] - lower) * Math.max(0, rank - seen) / counts[i];
      }
      seen += counts[i];
    }
    return bounds[bounds.length - 1];
  }

  function tokensPerSecond(tokens, genMs) {
    return tokens > 0 && genMs > 0 ? tokens / (genMs / 1000) : null;
  }

  // What each chart draws, per bucket: [{t (epoch s of the bucket's start), value}], value
  // null where the bucket has nothing to say (no calls: a gap, not a zero latency).
  const FIGURES = {
    requests: (b, step) => b.calls / (step / 60),            // calls per minute
    latency_p50: (b, step, bounds) => quantile(b.latency, bounds, 0.5),
    latency_p95: (b, step, bounds) => quantile(b.latency, bounds, 0.95),
    ttft_p50: (b, step, bounds) => quantile(b.ttft, bounds, 0.5),
    ttft_p95: (b, step, bounds) => quantile(b.ttft, bounds, 0.95),
    tokens_per_s: (b) => tokensPerSecond(b.tokens_out, b.gen_ms),
    errors: (b) => b.errors,
    rejected: (b) => b.rejected,
  };

  function figureSeries(series, model, figure) {
    const f = FIGURES[figure];
    if (!f) throw new Error(`no figure ${figure}`);
    return bucketsOf(series, model).map((b, i) => ({
      t: series.start + i * series.step_s,
      value: f(b, series.step_s, series.latency_bounds_ms),
    }));
  }

  // The window's totals of a model (or of all): calls, errors, rejected and percentiles.
  function summary(series, model) {
    const all = emptyBucket(series.latency_bounds_ms.length + 1);
    for (const b of bucketsOf(series, model)) addInto(all, b);
    const bounds = series.latency_bounds_ms;
    return { calls: all.calls, errors: all.errors, rejected: all.rejected,
      latency_p50: quantile(all.latency, bounds, 0.5),
      latency_p95: quantile(all.latency, bounds, 0.95),
      ttft_p50: quantile(all.ttft, bounds, 0.5),
      ttft_p95: quantile(all.ttft, bounds, 0.95),
      tokens_per_s: tokensPerSecond(all.tokens_out, all.gen_ms) };
  }

  // --- chart geometry --------------------------------------------------------------------

  // A round upper end for an axis (1, 2, 2.5, 5 times a power of ten) at or above max.
  function niceMax(max) {
    if (!(max > 0)) return 1;
    const power = 10 ** Math.floor(Math.log10(max));
    for (const step of [1, 2, 2.5, 5, 10]) {
      if (step * power >= max * (1 - 1e-12)) return step * power;
    }
    return 10 * power;
  }

  // Points of one or more lines in a width x height box: x by time over [start, end], y by
  // value over [0, top]; a null value breaks the line. Returns {top, lines: [[segments of
  // [x, y, value, t]]]}.
  function plot(lines, start, end, width, height) {
    const values = lines.flat().map((p) => p.value).filter((v) => v != null);
    const top = niceMax(Math.max(0, ...values));
    const span = Math.max(1, end - start);
    return {
      top,
      lines: lines.map((points) => {
        const segments = [];
        let current = null;
        for (const p of points) {
          if (p.value == null) { current = null; continue; }
          if (!current) { current = []; segments.push(current); }
          current.push([round((p.t - start) / span * width), round(height - p.value / top * height),
            p.value, p.t]);
        }
        return segments;
      }),
    };
  }

  function round(v) { return Math.round(v * 10) / 10; }

  // Labels for a time axis: n evenly spaced, as HH:MM.
  function timeTicks(start, end, n) {
    const out = [];
    for (let i = 0; i <= n; i++) {
      const t = start + (end - start) * i / n;
      const d = new Date(t * 1000);
      out.push({ t, label: `${String(d.getHours()).padStart(2, "0")}:`
        + `${String(d.getMinutes()).padStart(2, "0")}` });
    }
    return out;
  }

  // --- memory bars -------------------------------------------------------------------------

  // Segments of a bar of `total`: each holder's amount (measured where measured, else the
  // estimate, flagged), then "other": what of `inUse` (what the device or the host says is
  // in use) the measured holders do not account for; then what is free. Widths in percent
  // of total, never past 100 in all: an over-full bar is scaled down and says so.
  function memoryBar(total, holders, inUse) {
    const parts = holders.map((h) => ({ label: h.label, amount: Math.max(0, h.amount),
      estimated: !!h.estimated, need: h.need ?? null, kind: "engine" }));
    const measured = parts.filter((p) => !p.estimated).reduce((a, p) => a + p.amount, 0);
    const other = Math.max(0, inUse - measured);
    if (other > 0) parts.push({ label: "other", amount: other, kind: "other" });
    const used = parts.reduce((a, p) => a + p.amount, 0);
    const free = Math.max(0, total - used);
    parts.push({ label: "free", amount: free, kind: "free" });
    const scale = total > 0 ? 100 / Math.max(total, used) : 0;
    for (const p of parts) p.width = round(p.amount * scale);
    return { total, used, free, overfull: used > total, parts };
  }

  // --- the engine timeline -------------------------------------------------------------------

  const BUSY = new Set(["starting", "loading", "ready", "restarting", "stopping"]);

  // Per model, the spans of its engine's states over [start, end], its runs (one engine from
  // its start to its stop: the requests of one model served by one load, and why it ended)
  // and the marks worth a label (evictions with reasons, failures, restarts); reloads and
  // downloads on their own. Events are /admin/events/history's, oldest first; a model's
  // state before its first event in the window is unknown (null) unless `initial` (model ->
  // state) says it.
  function timeline(events, start, end, initial) {
    const lanes = new Map();
    const marks = [];
    const lane = (model) => {
      if (!lanes.has(model)) {
        const state = (initial && initial[model]) || null;
        lanes.set(model, { model, spans: [], runs: [], state, since: start,
          run: state && BUSY.has(state) ? newRun(start, state) : null });
      }
      return lanes.get(model);
    };
    for (const model of Object.keys(initial || {})) lane(model);
    for (const e of events) {
      if (e.ts < start || e.ts > end) continue;
      if (e.type === "engine") {
        const l = lane(e.model);
        if (l.state && BUSY.has(l.state)) l.spans.push({ state: l.state, from: l.since, to: e.ts });
        l.state = e.state; l.since = e.ts;
        followRun(l, e);
        const mark = engineMark(e);
        if (mark) marks.push(mark);
      } else if (e.type === "reload") {
        marks.push({ ts: e.ts, model: null, kind: e.ok === false ? "reload-refused" : "reload",
          text: e.ok === false ? `reload refused: ${e.error}` : "configuration reloaded" });
      } else if (e.type === "pull" && (e.state === "done" || e.state === "failed")) {
        marks.push({ ts: e.ts, model: e.model, kind: `pull-${e.state}`,
          text: e.state === "done" ? `downloaded ${e.model}`
            : `download of ${e.model} failed${e.error ? `: ${e.error.message}` : ""}` });
      }
    }
    for (const l of lanes.values()) {
      if (l.state && BUSY.has(l.state)) l.spans.push({ state: l.state, from: l.since, to: end });
      if (l.run) l.runs.push({ ...l.run, to: end });   // still running: ended null
      delete l.since; delete l.run;
    }
    return { lanes: [...lanes.values()].sort((a, b) => a.model.localeCompare(b.model)), marks };
  }

  // A run: from (its start, or the window's), ready (when it became ready; null: not yet
  // or before the window), load_s, to, and how it ended: ended (null: still running,
  // "evicted", "stopped", "failed"), why (the event's words), evicted_for, because (why the
  // model it made room for got it: "'chat' waited 30 s: max_wait_s").
  function newRun(ts, state) {
    return { from: ts, ready: state === "ready" ? ts : null, load_s: null, ended: null,
      why: null, evicted_for: null, because: null };
  }

  function followRun(l, e) {
    if (BUSY.has(e.state) && e.state !== "stopping" && !l.run) l.run = newRun(e.ts, e.state);
    if (!l.run) return;
    if (e.state === "ready" && l.run.ready == null) {
      l.run.ready = e.ts;
      l.run.load_s = e.load_s ?? null;
    }
    if (e.state === "stopping" || e.state === "stopped" || e.state === "failed") {
      const evicted = e.evicted_for != null || /^evicted/.test(e.reason || "");
      l.runs.push({ ...l.run, to: e.ts, ended: e.state === "failed" ? "failed"
        : evicted ? "evicted" : "stopped", why: e.reason || null,
      evicted_for: e.evicted_for ?? null, because: e.because ?? null });
      l.run = null;
    }
  }

  // A run in words, for its hover: how long it ran, its load, and why it ended, e.g.
  // "a ran 4 min 10 s (loaded in 2.0 s), evicted for 'b': 'b' waited 30 s: max_wait_s".
  function runText(model, run) {
    let text = `${model} ran ${duration(run.to - run.from)}`;
    if (run.load_s != null) text += ` (loaded in ${run.load_s.toFixed(1)} s)`;
    if (run.ended === "evicted") {   // the words of why, else the stop's reason as it is
      text += run.because && run.evicted_for != null
        ? `, evicted for '${run.evicted_for}': ${run.because}` : `, ${run.why || "evicted"}`;
    } else if (run.ended === "stopped") {
      text += `, stopped: ${run.why || "stopped"}`;
    } else if (run.ended === "failed") {
      text += `, failed: ${run.why || "?"}`;
    } else {
      text += ", still running";
    }
    return text;
  }

  // Seconds as a person reads them: "0.4 s", "12 s", "3 min 5 s", "2 h 1 min".
  function duration(s) {
    if (!(s >= 0)) return "?";
    if (s < 10) return `${s.toFixed(1)} s`;
    if (s < 120) return `${Math.round(s)} s`;
    const whole = Math.round(s);
    if (whole < 7200) return `${Math.floor(whole / 60)} min ${whole % 60} s`;
    return `${Math.floor(whole / 3600)} h ${Math.floor((whole % 3600) / 60)} min`;
  }

  function engineMark(e) {
    const base = { ts: e.ts, model: e.model };
    if (e.state === "ready") {
      return { ...base, kind: "ready",
        text: `${e.model} ready` + (e.load_s != null ? ` (loaded in ${e.load_s.toFixed(1)} s)` : "") };
    }
    if (e.state === "failed") return { ...base, kind: "failed", text: `${e.model} failed: ${e.reason || "?"}` };
    if (e.state === "restarting") {
      return { ...base, kind: "restarting", text: `${e.model} restarting: ${e.reason || "?"}` };
    }
    if (e.state === "stopping" && e.from !== "stopping") {
      const evicted = e.evicted_for != null || /^evicted/.test(e.reason || "");
      return { ...base, kind: evicted ? "evicted" : "stopped",
        text: `${e.model} ${evicted ? "" : "stopped: "}${e.reason || "stopped"}`
          + (evicted && e.because ? ` — ${e.because}` : "") };
    }
    if (e.state === "starting") return { ...base, kind: "starting", text: `${e.model} starting` };
    return null;
  }

  // Keep what happened in the last `keepS` seconds (and at most `max` events).
  function keepWindow(events, now, keepS, max) {
    const from = now - keepS;
    let i = 0;
    while (i < events.length && events[i].ts < from) i++;
    const kept = events.slice(i);
    return kept.length > max ? kept.slice(kept.length - max) : kept;
  }

  // --- server-sent events, read with fetch (EventSource cannot send a key) -------------------

  // Split a buffer into complete events' data (joined data: lines) and what is left.
  function sseEvents(buffer) {
    const out = [];
    let end;
    buffer = buffer.replace(/\r\n/g, "\n");
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      buffer = buffer.slice(end + 2);
      if (data) out.push(data);
    }
    return { events: out, rest: buffer };
  }

  // --- the playground's figures --------------------------------------------------------------

  // Time to first token and tokens/s of one streamed answer: t0 the request, first the
  // first content, last the end (ms, performance.now()); tokens as counted by the engine
  // (usage) where it said, else the content chunks seen.
  function streamFigures(t0, first, last, usageTokens, chunks) {
    const tokens = usageTokens ?? chunks;
    const ttft = first == null ? null : first - t0;
    const gen = first == null || last == null ? null : last - first;
    return { ttft_ms: ttft, tokens,
      tokens_per_s: gen > 0 && tokens > 1 ? (tokens - 1) / (gen / 1000) : null };
  }

  // --- the last calls (GET /admin/records) ----------------------------------------------------

  // Whose a call's error was (its record's error_source), in words for the cell's tooltip.
  const ERROR_SOURCES = {
    gateway: "the gateway's own error",
    engine: "the engine's own error answer, relayed as it said it",
    upstream: "the remote upstream's own error answer, relayed as it said it",
  };

  // A call's error as the table shows it: whose it was, then its code ("engine:
  // exceed_context_size_error"); null when the call ended without one.
  function callError(record) {
    const text = [record.error_source, record.error_code].filter(Boolean).join(": ");
    return text ? { text, title: ERROR_SOURCES[record.error_source] || "" } : null;
  }

  // --- live logs -----------------------------------------------------------------------------

  // Whether a journal line passes the filter: every word of it, case-insensitive.
  function lineMatches(line, filter) {
    const words = (filter || "").toLowerCase().split(/\s+/).filter(Boolean);
    const text = line.toLowerCase();
    return words.every((w) => text.includes(w));
  }

  // A bounded list of lines: the newest `max` kept.
  function appendBounded(lines, more, max) {
    const all = lines.concat(more);
    return all.length > max ? all.slice(all.length - max) : all;
  }

  return { bucketsOf, quantile, tokensPerSecond, figureSeries, summary, niceMax, plot,
    timeTicks, memoryBar, timeline, runText, duration, keepWindow, sseEvents, streamFigures,
    lineMatches, appendBounded, callError, FIGURES };
})();

if (typeof module === "object" && module.exports) module.exports = ConsoleCore;
