"""results.json -> results.md (tables with ratios) and latency.png."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _added(warm: dict[str, Any], path: str, key: str = "p50_ms") -> float:
    return float(warm[path][key] - warm["direct"][key])


def write_report(r: dict[str, Any], out: Path) -> None:
    lines = [f"# llm-gateway benchmarks ({r['plan']['rounds']} interleaved rounds, "
             f"{r['machine']['cores']} cores, {r['machine']['cpu']})", ""]
    lines += ["## Warm requests (max_tokens=1 chat, tiny model)", "",
              "| concurrency | path | p50 ms | p99 ms | req/s | added p50 ms |",
              "|---|---|---|---|---|---|"]
    for c, per in r["warm"].items():
        for path, s in per.items():
            added = "-" if path == "direct" else f"{_added(per, path):+.3f}"
            lines.append(f"| {c} | {path} | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} | "
                         f"{s['req_per_s']} | {added} |")
    lines += ["", "| concurrency | gateway added ÷ router added (p50) | gateway minus bare proxy "
              "(p50 ms, what our features cost) |", "|---|---|---|"]
    for c, per in r["warm"].items():
        router = _added(per, "router")
        ratio = _added(per, "gateway") / router if router > 0 else float("nan")
        features = per["gateway"]["p50_ms"] - per["bare"]["p50_ms"]
        lines.append(f"| {c} | {ratio:.2f} | {features:+.3f} |")
    ce = r["ceiling"]
    lines += ["", "## Proxy ceiling (instant fake engine, concurrency 64)", "",
              "| path | req/s | p50 ms | p99 ms | CPU µs/request |", "|---|---|---|---|---|"]
    for path, s in ce.items():
        lines.append(f"| {path} | {s['req_per_s']} | {s['p50_ms']:.3f} | {s['p99_ms']:.3f} | "
                     f"{s.get('cpu_us_per_req', '-')} |")
    if ce["bare"].get("req_per_s"):
        lines.append(f"\ngateway ÷ bare proxy throughput: "
                     f"{ce['gateway']['req_per_s'] / ce['bare']['req_per_s']:.2f}")
    lines += ["", "## Streaming (256 tokens)", "",
              "tokens/s: from the first token to the last; answer tokens/s: from the request "
              "to the last token. CPU: the proxy process's own, per event. router_engine: the "
              "router's child llama-server, read directly (the router's hop is router ÷ "
              "router_engine; the others' is ÷ direct).", "",
              "| path | tokens/s | answer tokens/s | first token ms | gap p50 ms | gap p99 ms | "
              "events per read | CPU µs/event | stalled starts re-run |",
              "|---|---|---|---|---|---|---|---|---|"]
    for path, s in r["streaming"].items():
        lines.append(f"| {path} | {s['tokens_per_s']} | {s.get('answer_tokens_per_s', '-')} | "
                     f"{s.get('first_token_ms', '-')} | {s['gap_p50_ms']} | {s['gap_p99_ms']} | "
                     f"{s['events_per_read']} | {s.get('cpu_us_per_event', '-')} | "
                     f"{s.get('stalled_starts_rerun', '-')} |")
    hop = r.get("streaming_hop")
    if hop:
        lines.append(f"\nthe hop, tokens/s ÷ the path's own engine read directly: gateway "
                     f"{hop['gateway']:.2f}, router {hop['router']:.2f}, bare {hop['bare']:.2f}")
    cs = r["cold_swap"]
    lines += ["", "## Cold start and swap (first byte, ms; 2 slots, 3 models)", "",
              "| | gateway | router |", "|---|---|---|",
              f"| cold start (stopped model) | {cs['cold_first_byte_ms']['gateway']} | "
              f"{cs['cold_first_byte_ms']['router']} |",
              f"| cold start, no KV cache kept (gateway: tiny-cold) | "
              f"{cs.get('cold_no_kv_cache_first_byte_ms', '-')} | "
              f"{cs['cold_first_byte_ms']['router']} |",
              *([f"| (of which the engine's own load, from its log) | "
                 f"{cs['cold_engine_load_ms'].get('gateway', '-')} | "
                 f"{cs['cold_engine_load_ms'].get('router', '-')} |"]
                if cs.get("cold_engine_load_ms") else []),
              *([f"| (the gateway's own account: request → wake, wake → ready, ready → "
                 f"first byte) | {phases(cs['cold_gateway_phases_ms'])} | - |"]
                if cs.get("cold_gateway_phases_ms") else []),
              f"| swap, every request evicts (p50) | {cs['swap_first_byte_ms']['gateway']} | "
              f"{cs['swap_first_byte_ms']['router']} |",
              f"| swap p99 | {cs['swap_p99_ms']['gateway']} | {cs['swap_p99_ms']['router']} |"]
    kv = r.get("kv_restore")
    if kv:
        lines += ["", "## A long prompt (~1460 tokens) again after its engine was stopped "
                  "(gateway, ms)", "",
                  "| KV cache | start (stop → ready) | first byte | both |", "|---|---|---|---|"]
        for label in ("restored", "cold"):
            k = kv[label]
            lines.append(f"| {label} | {k['start_ms']} | {k['first_byte_ms']} | "
                         f"{round(k['start_ms'] + k['first_byte_ms'], 2)} |")
    fp = r["footprint"]
    lines += ["", "## Footprint (gateway process)", "",
              f"- RSS idle: {fp['rss_idle_mib']} MiB; with {fp['open_streams']} open streams: "
              f"{fp['rss_peak_open_streams_mib']} MiB ({fp['open_stream_errors']} errors)",
              f"- socket activation to the first answer: "
              f"{fp['socket_activation_to_first_answer_ms']} ms"
              + (f" (a bare aiohttp proxy, socket-activated the same way: "
                 f"{fp['bare_socket_activation_to_first_answer_ms']} ms, the floor of any "
                 f"aiohttp gateway on this machine)"
                 if "bare_socket_activation_to_first_answer_ms" in fp else ""), "",
              f"Run took {r.get('seconds', '?')} s. Raw numbers: results.json; plot: latency.png."]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    _plot(r, out / "latency.png")


def _plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, values in r["warm_raw_c1"].items():
        xs = sorted(values)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        left.plot(xs, ys, label=name)
    left.set_xscale("log")
    left.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    left.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.set_xticks([1, 2, 3, 5, 10, 20, 50, 100])
    left.set_xlabel("latency, ms (max_tokens=1, sequential)")
    left.set_ylabel("fraction of requests")
    left.set_title("warm request latency (CDF)")
    left.legend()
    for name, gaps in r["streaming_gaps"].items():
        if gaps:
            right.hist(gaps, bins=50, histtype="step", label=name)
    right.set_xlabel("gap between reads, ms (256-token stream)")
    right.set_ylabel("reads")
    right.set_yscale("log")
    right.set_title("streaming: gaps between chunks")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def phases(ms: dict[str, float]) -> str:
    return " / ".join(str(ms.get(k, "-"))
                      for k in ("to_loading", "loading_to_ready", "ready_to_first_byte"))
