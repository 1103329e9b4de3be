"""Only what pyproject.toml cannot say: the native part, built where a C compiler is.

gatewayd/engine_park.c is no Python extension: it is preloaded into parked engine
servers (see the file). Built as gatewayd/_engine_park*.so; optional: without it the
gateway parks engines behind /bin/sh (a few ms more per cold start).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("gatewayd._engine_park", ["gatewayd/engine_park.c"],
                             libraries=["dl"], optional=True)])
