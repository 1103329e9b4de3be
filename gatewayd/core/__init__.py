"""The pure core: decisions and data, standard library only, no I/O.

Nothing here imports gatewayd.service, gatewayd.adapters or gatewayd.http, or a
library that talks to the outside world (tests/unit/test_layering.py)."""
