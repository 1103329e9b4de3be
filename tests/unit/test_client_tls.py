"""aiohttp imported with its CA certificates deferred (adapters/client_tls.py), in a fresh
interpreter as `llm-gateway serve` does: the default context is made empty, gets the
system's certificates from load_deferred(), and nothing else is touched."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, ssl
from gatewayd.adapters.client_tls import deferred_ca_loading, load_deferred
real = ssl.create_default_context
with deferred_ca_loading():
    import aiohttp.connector as connector
    other = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)   # made as usual
context = connector._SSL_CONTEXT_VERIFIED
unverified = connector._SSL_CONTEXT_UNVERIFIED
out = {"before": len(context.get_ca_certs()) + len(unverified.get_ca_certs()),
       "restored": ssl.create_default_context is real
                   and "set_default_verify_paths" not in ssl.SSLContext.__dict__,
       "verify": context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname,
       "other_is_server": other.verify_mode == ssl.CERT_NONE}
out["loaded"] = load_deferred()
out["after"] = len(context.get_ca_certs())
out["unverified_after"] = len(unverified.get_ca_certs())
out["unverified_off"] = unverified.verify_mode == ssl.CERT_NONE
out["system"] = len(ssl.create_default_context().get_ca_certs())
print(json.dumps(out))
"""


def test_the_default_context_gets_its_certificates_after_start_up() -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          check=True)
    out = json.loads(proc.stdout)
    assert out["before"] == 0 and out["restored"] and out["verify"]
    assert out["other_is_server"]    # CLIENT_AUTH contexts are not deferred
    assert out["loaded"] == 2 and out["after"] == out["system"]
    assert out["unverified_after"] == out["system"] and out["unverified_off"]
