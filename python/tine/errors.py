"""One exception class per error code of the tine API (docs/openapi.yaml)."""

from __future__ import annotations


class TineError(Exception):
    """Any error the tine daemon reported (or a failure to reach it)."""

    code = "internal"

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.message = message
        self.status = status


class InvalidInput(TineError):
    code = "invalid_input"


class Unauthorized(TineError):
    code = "unauthorized"


class NotFound(TineError):
    code = "not_found"


class AlreadyExists(TineError):
    code = "already_exists"


class Ambiguous(TineError):
    code = "ambiguous"


class Corrupt(TineError):
    code = "corrupt"


class IoError(TineError):
    code = "io"


class Locked(TineError):
    code = "locked"


class Unsupported(TineError):
    code = "unsupported"


class Capacity(TineError):
    """The daemon runs as many sandboxes as it may; retry later."""

    code = "capacity"


class Conflict(TineError):
    """A merge left conflicts, or a state was asked for over one that runs."""

    code = "conflict"


class Unavailable(TineError):
    """A remote could not be reached; retrying later can succeed."""

    code = "unavailable"


class Internal(TineError):
    code = "internal"


class ConnectionFailed(TineError):
    """The daemon could not be reached."""

    code = "connection"


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidInput,
        Unauthorized,
        NotFound,
        AlreadyExists,
        Ambiguous,
        Corrupt,
        IoError,
        Locked,
        Unsupported,
        Capacity,
        Conflict,
        Unavailable,
        Internal,
    )
}


def from_response(status: int, body: bytes) -> TineError:
    """The exception for an error response `{"error": {"code", "message"}}`."""
    import json

    try:
        err = json.loads(body)["error"]
        code, message = err["code"], err["message"]
    except (ValueError, KeyError, TypeError):
        code, message = "internal", body.decode("utf-8", "replace") or f"HTTP {status}"
    return _BY_CODE.get(code, Internal)(message, status)
