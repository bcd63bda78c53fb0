"""Every error respool raises, in one tree (in the manner of httpx's `_exceptions.py`).

    Exception
    ├── RespoolError                      what a client is told: the API renders it as OpenAI's
    │   │                                 envelope (PROTOCOL.md §5.6) with its status
    │   ├── InvalidRequestError           400 invalid_request_error (carries `param`, `code`)
    │   │   ├── MissingParameterError     400 code missing_required_parameter
    │   │   ├── UnsupportedParameterError 400 code unsupported_parameter
    │   │   ├── PreviousResponseNotFoundError  400 code previous_response_not_found
    │   │   ├── ToolOutputMissingError    400 a function call with no output (no code, as OpenAI)
    │   │   └── RequestTooLargeError      413 code request_too_large (RESPOOL_MAX_BODY_BYTES)
    │   ├── RequestTimeoutError           408 code request_timeout (RESPOOL_BODY_TIMEOUT_SECONDS)
    │   ├── AuthenticationError           401
    │   ├── NotFoundError                 404 (ResponseNotFoundError, ModelNotFoundError)
    │   ├── WebSocketNotSupportedError    426 (the Responses API over WebSocket: clients fall back to HTTP)
    │   ├── OverloadedError               429 + retry-after (the queue is full: nothing was recorded)
    │   │   ├── RateLimitError            an owner's requests over RESPOOL_RATE_LIMIT_PER_MINUTE
    │   │   └── StreamLimitError          an owner's open streams at RESPOOL_MAX_STREAMS_PER_KEY
    │   └── UnavailableError              503 + retry-after (Redis or Postgres unreachable)
    │       └── UnavailableAfterCommitError   503, never retried: the create was already recorded
    ├── UpstreamError                     the upstream refused or broke a response's call: the
    │   │                                 response ends `failed` with its message and `code`
    │   ├── TransientUpstreamError        worth another attempt, if nothing reached a client yet
    │   ├── UpstreamStreamError           what the upstream streamed is a failure or breaks its protocol
    │   └── MidStreamError                any of those after output had started: carries that output
    ├── ToolError                         a server-side tool could not be reached or run: the model,
    │   │                                 or the Response's failure, is told its message
    │   └── OutboundRefusedError          the SSRF rule refused a destination (worker/outbound.py)
    ├── FencedOutError                    control signal: another attempt holds the response now
    ├── CancelRequestedError              control signal: a cancel was requested for the response
    └── ConfigError (also a ValueError)   the routing configuration is unusable, found at start

The core raises these; it never raises HTTP exceptions (STYLE.md §10). Foreign errors (httpx,
redis, SQLAlchemy) are mapped at their boundary: `worker.runner.upstream`, `worker.outages`.
"""

from __future__ import annotations


class RespoolError(Exception):
    """Base of every error respool reports to a client."""

    status = 500
    type = "server_error"
    code: str | None = None
    param: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if param is not None:
            self.param = param
        if code is not None:
            self.code = code

    def to_body(self) -> dict[str, object]:
        """The error envelope, `{"error": {message, type, param, code}}`."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequestError(RespoolError):
    status = 400
    type = "invalid_request_error"
    code: str | None = "invalid_value"


class MissingParameterError(InvalidRequestError):
    code = "missing_required_parameter"

    def __init__(self, param: str) -> None:
        super().__init__(f"Missing required parameter: '{param}'.", param=param)


class UnsupportedParameterError(InvalidRequestError):
    code = "unsupported_parameter"


class PreviousResponseNotFoundError(InvalidRequestError):
    code = "previous_response_not_found"

    def __init__(self, response_id: str) -> None:
        super().__init__(
            f"Previous response with id '{response_id}' not found.", param="previous_response_id"
        )


class ToolOutputMissingError(InvalidRequestError):
    """A function call with no output before the next input message or the end, in the input or
    along the previous_response_id chain: OpenAI's own 400, word for word."""

    code = None

    def __init__(self, call_id: str) -> None:
        super().__init__(f"No tool output found for function call {call_id}.", param="input")


class RequestTooLargeError(InvalidRequestError):
    """A body over the size limit: refused before more of it is read (never retried by the SDK)."""

    status = 413
    code = "request_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"The request body is larger than this server accepts ({limit:,} bytes, RESPOOL_MAX_BODY_BYTES).",
        )


class RequestTimeoutError(RespoolError):
    """A body that did not arrive in time: nothing was read into a request, so the SDK may retry it
    (PROTOCOL.md §5.5); the connection is closed after the answer."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"

    def __init__(self, timeout_seconds: float) -> None:
        super().__init__(
            f"The request body did not arrive within {timeout_seconds:g} s (RESPOOL_BODY_TIMEOUT_SECONDS)."
        )


class AuthenticationError(RespoolError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFoundError(RespoolError):
    status = 404
    type = "invalid_request_error"


class ResponseNotFoundError(NotFoundError):
    def __init__(self, response_id: str) -> None:
        super().__init__(f"Response with id '{response_id}' not found.", param="response_id")


class ConversationNotFoundError(NotFoundError):
    def __init__(self, conversation_id: str, param: str = "conversation_id") -> None:
        super().__init__(f"Conversation with id '{conversation_id}' not found.", param=param)


class ConversationItemNotFoundError(NotFoundError):
    def __init__(self, item_id: str) -> None:
        super().__init__(f"Item with id '{item_id}' not found.", param="item_id")


class ModelNotFoundError(NotFoundError):
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist or is not routed.", param="model")


class WebSocketNotSupportedError(RespoolError):
    """A WebSocket upgrade on `/v1/responses`: respool serves the Responses API over HTTP only. 426
    Upgrade Required is the refusal clients fall back from (Codex CLI switches to HTTP at once)."""

    status = 426
    type = "invalid_request_error"
    code = "websocket_not_supported"

    def __init__(self) -> None:
        super().__init__(
            "This server does not serve the Responses API over WebSocket; use HTTP: POST /v1/responses, "
            "with stream=true for server-sent events."
        )


class OverloadedError(RespoolError):
    """More responses wait in the queue than the configured limit: come back later (PROTOCOL.md §5.5:
    429 with `retry-after`, which the SDK honours). Raised before anything is recorded."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"
    retry_after_seconds = 5


class RateLimitError(OverloadedError):
    """An owner sent more requests than its rate allows; `retry_after_seconds` is the real wait
    until one more is allowed (whole seconds, rounded up, as `retry-after` carries them)."""

    def __init__(self, owner: str, per_minute: int, retry_after_seconds: int) -> None:
        super().__init__(
            f"Rate limit reached for '{owner}' on requests per minute: limit {per_minute} "
            f"(RESPOOL_RATE_LIMIT_PER_MINUTE). Please try again in {retry_after_seconds} s."
        )
        self.retry_after_seconds = retry_after_seconds


class StreamLimitError(OverloadedError):
    """An owner already has as many event streams open as it may; one must end first."""

    def __init__(self, owner: str, limit: int) -> None:
        super().__init__(
            f"'{owner}' already has {limit} event streams open, its limit (RESPOOL_MAX_STREAMS_PER_KEY); "
            "close one, or retry shortly. Nothing was created."
        )


class UnavailableError(RespoolError):
    """A backing server is unreachable; the client should retry after a moment."""

    status = 503
    type = "server_error"
    code = "service_unavailable"
    retry_after_seconds = 1


class UnavailableAfterCommitError(UnavailableError):
    """A backing server failed after a create was recorded. The SDK must not retry it: it would
    create the response twice (PROTOCOL.md §5.5). The message names the response."""


class UpstreamFailedError(RespoolError):
    """The upstream failed a call the client waits for in its request (`/responses/compact`)."""

    status = 502
    type = "server_error"
    code = "upstream_error"


# --- the upstream --------------------------------------------------------------------------------

REDACTED = "[redacted]"
# What a refusal by the upstream tells a client (a failed Response's `error.code`), by HTTP status.
_UPSTREAM_CODES = {401: "upstream_unauthorized", 403: "upstream_forbidden", 404: "model_not_found"}


def redact(text: str, secret: str) -> str:
    """`text` with every `secret` in it replaced by `[redacted]`."""
    return text.replace(secret, REDACTED) if secret else text


class UpstreamError(Exception):
    """The upstream refused or broke the request; `status` is its HTTP status, if it answered."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    @property
    def code(self) -> str:
        """The failed Response's `error.code`: what the upstream's refusal says, else `server_error`."""
        return _UPSTREAM_CODES.get(self.status or 0, "server_error")

    def redact(self, secret: str) -> UpstreamError:
        """Cut `secret` out of the message, in place; returns self."""
        self.message = redact(self.message, secret)
        self.args = (self.message, *self.args[1:])
        return self


class TransientUpstreamError(UpstreamError):
    """A fault another attempt may not meet; `retry_after` is the upstream's wait hint in seconds."""

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message, status)
        self.retry_after = retry_after

    def gave_up(self, attempts: int) -> UpstreamError:
        """The final error once `attempts` attempts all failed, this one last."""
        return UpstreamError(f"{self.message}; gave up after {attempts} attempts", self.status)


class UpstreamStreamError(UpstreamError):
    """What the upstream streamed ends the response failed: it said so (a native `response.failed` or
    `error` event), or it broke its protocol (arguments outside any call, a call it finished whose
    arguments are not JSON, a stream that ended before its response did)."""


class MidStreamError(UpstreamError):
    """An upstream fault after output had started: `output` is what was streamed, its open items
    ended `incomplete`. The fault itself is the cause (`__cause__`); message, status and code are its."""

    def __init__(self, cause: UpstreamError, output: list[dict[str, object]]) -> None:
        super().__init__(cause.message, cause.status)
        self.output = output
        self.cause = cause

    @property
    def code(self) -> str:
        return self.cause.code


# --- control signals: they end an attempt, and never reach a client -----------------------------


class FencedOutError(Exception):
    """Another attempt holds the response now: this one must write nothing more."""


class CancelRequestedError(Exception):
    """A cancel was requested for the response this attempt is running."""


class ConfigError(ValueError):
    """The routing configuration is unusable; raised at start, never per request."""


class ToolError(Exception):
    """A server-side tool (an MCP server, a search backend) could not be reached or run."""

    def __init__(self, message: str, output: list[dict[str, object]] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.output = output or []  # the response's output when it failed on this, as told


class OutboundRefusedError(ToolError):
    """An outbound destination the SSRF rule refuses (DESIGN.md §13)."""
