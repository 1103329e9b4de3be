"""Adapters: every piece of I/O (D-Bus/systemd, NVML, journald, SQLite, files,
sd_notify), each behind a small Protocol of gatewayd.core.ports where the core
or the service layer uses it."""
