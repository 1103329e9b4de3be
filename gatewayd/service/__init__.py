"""The service layer: turns requests and systemd's signals into calls into the core
and effects through the ports. Imports the core; never the HTTP layer."""
