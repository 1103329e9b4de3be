"""The one way the gateway speaks HTTP to an engine's unix socket.

- `framing`: the request head and the one parser of answers (pure; fuzzed on its own);
- `connection`, `pool`, `client`: the proxy's pooled keep-alive client (`EngineClient`);
- `exchange`: the gateway's own short looks (readiness, /props, /metrics, KV cache);
http/proxy orchestrates the relay to the client; nothing outside this package parses an
engine's bytes.
"""
