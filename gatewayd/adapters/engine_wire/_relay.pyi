# gatewayd/adapters/engine_wire/relay.c (built by setup.py where a C compiler is; optional)
HANDBACK: int
ENGINE_EOF: int
ENGINE_ERROR: int
IDLE: int
CLIENT_GONE: int
STALLED: int
CANCELLED: int
BUF_SIZE: int

def forward(engine_fd: int, client_fd: int, cancel_fd: int, read_timeout_s: float,
            stall_timeout_s: float, /
            ) -> tuple[int, int, bytes, int, bytes, int, float, bytes]: ...

def interrupt(cancel_fd: int, engine_fd: int, /) -> None: ...
