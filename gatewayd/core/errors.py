"""One error hierarchy for the whole gateway.

Every class carries the HTTP status and the OpenAI error `type`/`code` it is
rendered with, so handlers raise and one place renders. Adapters translate
library errors (D-Bus, sqlite, NVML) into these at their edge; the core never
sees a foreign exception type.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, ClassVar


class ErrorSource(StrEnum):
    """Who produced an error answer: the gateway itself, a local engine, or a remote
    upstream. Told in ERROR_SOURCE_HEADER on every answer of status >= 400, as `source`
    inside the gateway's own error bodies and events, and as `error_source` in the call
    records. An engine's or upstream's body is relayed as it was said: the header tells."""

    GATEWAY = "gateway"
    ENGINE = "engine"
    UPSTREAM = "upstream"


ERROR_SOURCE_HEADER = "LLM-Gateway-Error-Source"
# on each 503 of the gateway's own: no answer was or will be delivered for the request, so a
# balancer may send it to another gateway (docs/fleet.md); HAProxy matches the status
RETRY_HEADER = "LLM-Gateway-Retry"


def error_body(message: str, *, type_: str, code: str | None, param: str | None = None,
               extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The OpenAI-shaped error envelope of the gateway's own errors:
    {"error": {message, type, param, code, ...extra, source: "gateway"}} (the SDKs read
    the first four and ignore the rest)."""
    error: dict[str, Any] = {"message": message, "type": type_, "param": param, "code": code}
    if extra:
        error.update(extra)
    error["source"] = ErrorSource.GATEWAY.value
    return {"error": error}


# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors); the
# SDKs choose their exception class from the status, the type says the same in words
ANTHROPIC_ERROR_TYPES: Mapping[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
    422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
    529: "overloaded_error"}


def anthropic_error_body(status: int, message: str, *, code: str | None = None,
                         extra: Mapping[str, Any] | None = None,
                         source: ErrorSource | None = ErrorSource.GATEWAY) -> dict[str, Any]:
    """The Anthropic error shape, {"type": "error", "error": {type, message}}, for the
    /v1/messages paths; our own code and source ride along inside `error`, extra beside
    it. source None: an engine's or upstream's words retold in this shape (the
    ERROR_SOURCE_HEADER tells whose)."""
    type_ = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500
                                      else "api_error")
    error: dict[str, Any] = {"type": type_, "message": message}
    if code is not None:
        error["code"] = code
    if source is not None:
        error["source"] = source.value
    return {"type": "error", "error": error, **(extra or {})}


class GatewayError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    code: ClassVar[str] = "internal_error"
    headers: Mapping[str, str] = {}   # sent with the error (WWW-Authenticate)
    closes_connection: ClassVar[bool] = False   # the connection cannot carry another request

    def __init__(self, message: str, *, param: str | None = None,
                 retry_after: int | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after   # seconds, sent as a Retry-After header
        self.extra = extra

    def body(self) -> dict[str, Any]:
        """The OpenAI-shaped error envelope, plus our extra fields; a list of
        available_models also beside `error` (the shape clients of the seed read)."""
        body = error_body(self.message, type_=self.type, code=self.code, param=self.param,
                          extra=self.extra)
        if "available_models" in self.extra:
            body["available_models"] = self.extra["available_models"]
        return body

    def anthropic_body(self) -> dict[str, Any]:
        """The same error in Anthropic's shape (for /v1/messages); available_models, where
        there is such a list, beside `error`."""
        extra = ({"available_models": self.extra["available_models"]}
                 if "available_models" in self.extra else None)
        return anthropic_error_body(self.status, self.message, code=self.code, extra=extra)


class InvalidRequest(GatewayError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


class ModelNotFound(GatewayError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class AlreadyRunning(GatewayError):
    status, type, code = 409, "invalid_request_error", "already_running"


class EngineLimitReached(GatewayError):
    status, type, code = 503, "server_error", "engine_limit_reached"


class InsufficientGpu(GatewayError):
    status, type, code = 503, "server_error", "insufficient_gpu"


class InsufficientMemory(GatewayError):
    """The host's memory (RAM) cannot hold the engine: not free now and nothing may go, or
    more than the RAM budget could ever give it. (GPU memory short: InsufficientGpu, whose
    code predates this one; both carry memory="gpu"/"ram" with the figures.)"""
    status, type, code = 503, "server_error", "insufficient_memory"


class GpuUnavailable(GatewayError):
    """NVML answered at start but fails now (a lost GPU, a driver error): admission cannot
    know the free memory, so it refuses instead of guessing; running engines are left."""
    status, type, code = 503, "server_error", "gpu_unavailable"


class EngineNotRunning(GatewayError):
    status, type, code = 409, "invalid_request_error", "engine_not_running"


class EngineFailed(GatewayError):
    """The engine could not be started or died while loading."""

    status, type, code = 502, "server_error", "engine_failed"


class EngineOutOfMemory(EngineFailed):
    """The engine was killed for want of memory (the kernel's OOM killer, or its unit's
    MemoryMax=): it is not restarted into the same wall; what it needed and what was free
    ride along."""

    status, type, code = 503, "server_error", "engine_out_of_memory"


class ModelRequired(GatewayError):
    status, type, code = 400, "invalid_request_error", "model_required"


class NoEngineReady(GatewayError):
    status, type, code = 503, "server_error", "no_engine_ready"


class BodyTooLarge(GatewayError):
    """A body past its limit: refused before it is read whole, so the rest of it is still
    on the connection, which cannot carry another request (closed, and the answer says
    so: a client's next request would otherwise meet a connection already gone)."""

    status, type, code = 413, "invalid_request_error", "request_too_large"
    closes_connection = True


class BodyTooSlow(GatewayError):
    """A body that stopped coming: no byte of it for the gateway's idle bound. The rest
    may still come on the connection, which cannot carry another request (closed)."""

    status, type, code = 408, "invalid_request_error", "request_timeout"
    closes_connection = True


class EngineUnavailable(GatewayError):
    """The engine's socket refused or dropped the request before it was answered."""

    status, type, code = 502, "server_error", "engine_unavailable"
    # the socket refused the connection and no earlier try went out on another: the
    # request reached no process (a just-dead engine's shut socket), so it may be sent
    # to the engine systemd restarts (Dispatcher.journey)
    reached_no_process: bool = False


class EngineBusy(GatewayError):
    """Everything the engine serves at once stayed in use while the request waited for a
    turn (up to read_timeout_s): try again."""

    status, type, code = 503, "server_error", "engine_busy"


class UpstreamUnavailable(GatewayError):
    """A remote upstream refused the connection, or dropped it before answering."""

    status, type, code = 502, "server_error", "upstream_unavailable"


class UpstreamUnreachable(GatewayError):
    """Every upstream that serves the model is known to be down (its probes fail):
    refused at once instead of waiting out a connection timeout."""

    status, type, code = 503, "server_error", "upstream_unreachable"


class UpstreamTimeout(GatewayError):
    """A remote upstream took longer than its timeout to connect or to answer."""

    status, type, code = 504, "server_error", "upstream_timeout"


class UpstreamFailed(GatewayError):
    """A remote upstream broke off an answer it had begun (told as a stream's error event)."""

    status, type, code = 502, "server_error", "upstream_failed"


class AdapterNotLoaded(GatewayError):
    """The model's engine was started before its LoRA adapter was configured: it restarts
    with it once idle (a reload restarts an engine whose settings changed)."""

    status, type, code = 503, "server_error", "adapter_not_loaded"


class ModelNotLoaded(GatewayError):
    """The model's engine is not running and the request said autoload=false."""

    status, type, code = 503, "server_error", "model_not_loaded"


class MissingApiKey(GatewayError):
    status, type, code = 401, "invalid_request_error", "missing_api_key"
    headers: Mapping[str, str] = {"WWW-Authenticate": 'Bearer realm="llm-gateway"'}


class InvalidApiKey(GatewayError):
    status, type, code = 401, "invalid_request_error", "invalid_api_key"
    headers: Mapping[str, str] = {"WWW-Authenticate": 'Bearer realm="llm-gateway"'}


class ScopeNotAllowed(GatewayError):
    status, type, code = 403, "invalid_request_error", "scope_not_allowed"


class AdminNotAllowed(GatewayError):
    status, type, code = 403, "invalid_request_error", "admin_not_allowed"


class AdminNotPublic(GatewayError):
    """/admin/* asked for on the public port while it is served on the admin socket only."""
    status, type, code = 404, "invalid_request_error", "admin_not_public"


class ModelNotAllowed(GatewayError):
    status, type, code = 403, "invalid_request_error", "model_not_allowed"


class RouteNotFound(GatewayError):
    """The path is not in the route table (core/routes.py): nothing behind it runs."""
    status, type, code = 404, "invalid_request_error", "not_found"


class MethodNotAllowed(GatewayError):
    """The path is in the route table, but not for this method."""
    status, type, code = 405, "invalid_request_error", "method_not_allowed"

    def __init__(self, message: str, *, allow: str) -> None:
        super().__init__(message)
        self.headers = {"Allow": allow}


class HostNotAllowed(GatewayError):
    """The Host header names another server (a DNS rebinding page, a misdirected
    request): answered 421 before anything runs."""
    status, type, code = 421, "invalid_request_error", "host_not_allowed"


class OriginNotAllowed(GatewayError):
    """A web page of another origin (not in [listen] allowed_origins) asked."""
    status, type, code = 403, "invalid_request_error", "origin_not_allowed"


class CrossSiteRequest(OriginNotAllowed):
    """A page of another site sent a request without an Origin (an <img>, a <script>, a
    link it opened): its browser says so in Sec-Fetch-Site. Only a navigation to the
    status page or /health may come from elsewhere."""
    code = "cross_site_request"


class UnsupportedMediaType(GatewayError):
    """A JSON endpoint sent another content type (a web form's, text/plain...)."""
    status, type, code = 415, "invalid_request_error", "unsupported_media_type"


class BadFraming(GatewayError):
    """A request whose body's length cannot be known (RFC 9112 6.3: a Transfer-Encoding
    whose last coding is not chunked), or whose body the HTTP parser refused part-way (a
    broken chunk size, Content-Length or Transfer-Encoding in its trailers, a content
    coding it cannot decode): refused, and
    its connection closed, since where its body ends (and the next request begins) is
    anyone's guess."""

    status, type, code = 400, "invalid_request_error", "bad_framing"
    closes_connection = True


class HeadersTooLarge(GatewayError):
    """The request's head is over what the gateway parses."""
    status, type, code = 431, "invalid_request_error", "request_header_fields_too_large"


class ShuttingDown(GatewayError):
    """The gateway is stopping and its drain time (shutdown_timeout_s) ran out."""
    status, type, code = 503, "server_error", "shutting_down"


class ConcurrencyLimit(GatewayError):
    status, type, code = 429, "rate_limit_error", "concurrency_limit"


class QueueFull(GatewayError):
    status, type, code = 503, "server_error", "queue_full"


class TooManyLogFollows(GatewayError):
    """A journal follow (?follow=1) past the most that may run at once: each is a
    journalctl process, held as long as its client stays."""

    status, type, code = 429, "rate_limit_error", "too_many_log_follows"


class NotASystemdUnit(GatewayError):
    """The gateway's own journal asked for where it does not run as a systemd unit."""

    status, type, code = 409, "invalid_request_error", "not_a_systemd_unit"


class JournalUnavailable(GatewayError):
    """journalctl could not be run (not installed, not allowed)."""

    status, type, code = 503, "server_error", "journal_unavailable"


class ConfigError(GatewayError):
    """The configuration is wrong; the message names the key and the fix."""

    status, type, code = 500, "server_error", "config_error"


class ConfigInvalid(GatewayError):
    """A reload refused: the new configuration does not parse or validate."""
    status, type, code = 422, "invalid_request_error", "config_invalid"


class EngineBinaryMissing(ConfigError):
    """The configured engine server cannot be run (missing, not executable)."""


class SystemdUnavailable(GatewayError):
    """No systemd manager (or no D-Bus) to run engines under."""

    status, type, code = 503, "server_error", "systemd_unavailable"


class UnitOperationFailed(GatewayError):
    """systemd refused or failed a unit operation (start, stop, kill...)."""

    status, type, code = 502, "server_error", "unit_operation_failed"


class UnitAlreadyActive(UnitOperationFailed):
    """systemd already runs a unit of that name: adopt it rather than fail."""

    status, type, code = 409, "invalid_request_error", "unit_already_active"


class AccessDenied(UnitOperationFailed):
    """polkit (or the bus policy) said no to a unit operation."""

    status, type, code = 403, "permission_error", "access_denied"


class AnswerTooLarge(GatewayError):
    """An engine's or upstream's answer read whole went past max_answer_mb: refused rather
    than held in memory."""

    status, type, code = 502, "server_error", "answer_too_large"


class EventTooLarge(AnswerTooLarge):
    """One event of a stream went past max_event_mb without its end (a blank line): the
    stream ends with this as its error event (its status was sent)."""

    code = "event_too_large"


class UnsafePath(GatewayError):
    """A value from outside (a name, a hub's file name or hash) that would not stay one
    file name under the gateway's own folder: refused, never rewritten
    (core/safe_paths)."""

    status, type, code = 400, "invalid_request_error", "unsafe_path"


class PullError(GatewayError):
    """Getting a model from a hub failed; nothing half-written is left in models_dir."""

    status, type, code = 502, "server_error", "pull_failed"


class ModelSourceInvalid(PullError):
    """`pull` was given something that is not REPO[@REVISION][:FILE or :QUANT]."""

    status, type, code = 400, "invalid_request_error", "invalid_model_source"


class PullNotPossible(PullError):
    """Pulling needs a models_dir the gateway may write (none is configured, or it is
    read-only to the service)."""

    status, type, code = 409, "invalid_request_error", "models_dir_unusable"


class HubRepoNotFound(PullError):
    status, type, code = 404, "invalid_request_error", "hub_repo_not_found"


class HubFileNotFound(PullError):
    """The repository exists but holds no file that matches (the message lists what it
    holds)."""

    status, type, code = 404, "invalid_request_error", "hub_file_not_found"


class HubFileAmbiguous(PullError):
    """Several of the repository's files match: the caller names one."""

    status, type, code = 409, "invalid_request_error", "hub_file_ambiguous"


class HubGatedRepo(PullError):
    """A gated (or private) repository, and no token the hub accepts for it."""

    status, type, code = 403, "permission_error", "hub_gated_repo"


class HubUnreachable(PullError):
    """No answer from the hub: offline, DNS, proxy, TLS, or a timeout."""

    status, type, code = 502, "server_error", "hub_unreachable"


class ChecksumMismatch(PullError):
    """The bytes received do not hash to what the hub says the file is: discarded."""

    status, type, code = 502, "server_error", "checksum_mismatch"


class InsufficientStorage(PullError):
    """The files do not fit in models_dir's filesystem (with its reserve), checked before
    the download starts, or the disk filled while it ran."""

    status, type, code = 507, "server_error", "insufficient_storage"


class ModelExists(PullError):
    """A model of that name is already in the catalog (or being pulled from elsewhere)."""

    status, type, code = 409, "invalid_request_error", "model_exists"


class ModelDownloading(GatewayError):
    """A model with a source is being pulled and will not be here within the caller's
    wait: ask again after Retry-After (the download's ETA)."""

    status, type, code = 503, "server_error", "model_downloading"


class ModelInUse(GatewayError):
    """`rm` of a model whose engine runs or is pinned (`--force` stops it first)."""

    status, type, code = 409, "invalid_request_error", "model_in_use"


class ModelNotRemovable(GatewayError):
    """`rm` of a model the configuration names, or one outside models_dir: the gateway
    deletes only the files it would have found itself."""

    status, type, code = 409, "invalid_request_error", "model_not_removable"


# -- batch jobs (core/batch) ----------------------------------------------------------

class BatchFileInvalid(GatewayError):
    """An uploaded batch file with bad lines: each named with its number and why."""

    status, type, code = 400, "invalid_request_error", "invalid_batch_file"


class BatchInvalid(GatewayError):
    """A batch that cannot be created from its file as asked."""

    status, type, code = 400, "invalid_request_error", "invalid_batch"


class FileNotFound(GatewayError):
    status, type, code = 404, "invalid_request_error", "file_not_found"


class BatchNotFound(GatewayError):
    status, type, code = 404, "invalid_request_error", "batch_not_found"


class BatchEnded(GatewayError):
    """A cancel of a batch that has already ended."""

    status, type, code = 409, "invalid_request_error", "batch_ended"


class FileInUse(GatewayError):
    """A delete of a batch's input file while the batch runs."""

    status, type, code = 409, "invalid_request_error", "file_in_use"


class StorageFull(GatewayError):
    """Over a bound on what is kept (files, bytes, the disk's reserve)."""

    status, type, code = 507, "server_error", "batch_storage_full"
