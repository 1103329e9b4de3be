"""Only what pyproject.toml cannot say: the native parts, built where a C compiler is.

gatewayd/engine_park.c is no Python extension: it is preloaded into parked engine
servers (see the file). Built as gatewayd/_engine_park*.so; optional: without it the
gateway parks engines behind /bin/sh (a few ms more per cold start).
gatewayd/adapters/engine_wire/relay.c (gatewayd.adapters.engine_wire._relay) passes a
stream's events from the engine to the client without the interpreter; optional: without
it the relay is Python's (more CPU per event, same answers).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("gatewayd._engine_park", ["gatewayd/engine_park.c"],
                             libraries=["dl"], optional=True),
                   Extension("gatewayd.adapters.engine_wire._relay",
                             ["gatewayd/adapters/engine_wire/relay.c"], optional=True)])
