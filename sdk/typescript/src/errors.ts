// One error class per error code of the tine API (docs/openapi.yaml).

/** Any error the tine daemon reported (or a failure to reach it). */
export class TineError extends Error {
  /** The API's error code (`not_found`, ...), or `connection`. */
  readonly code: string;
  /** The HTTP status, when the daemon answered. */
  readonly status: number | undefined;

  constructor(code: string, message: string, status?: number) {
    super(message);
    this.name = new.target.name;
    this.code = code;
    this.status = status;
  }
}

export class InvalidInput extends TineError {}
export class Unauthorized extends TineError {}
export class NotFound extends TineError {}
export class AlreadyExists extends TineError {}
export class Ambiguous extends TineError {}
export class Locked extends TineError {}
export class Unsupported extends TineError {}
/** The daemon runs as many sandboxes as it may; retry later. */
export class Capacity extends TineError {}
/** A merge left conflicts, or a state was asked for over one that runs. */
export class Conflict extends TineError {}
/** A remote could not be reached; retrying later can succeed. */
export class Unavailable extends TineError {}
export class Corrupt extends TineError {}
export class IoError extends TineError {}
export class Internal extends TineError {}
/** The daemon could not be reached. */
export class ConnectionFailed extends TineError {}

const BY_CODE: Record<string, new (code: string, message: string, status?: number) => TineError> = {
  invalid_input: InvalidInput,
  unauthorized: Unauthorized,
  not_found: NotFound,
  already_exists: AlreadyExists,
  ambiguous: Ambiguous,
  locked: Locked,
  unsupported: Unsupported,
  capacity: Capacity,
  conflict: Conflict,
  unavailable: Unavailable,
  corrupt: Corrupt,
  io: IoError,
  internal: Internal,
};

/** The error for an error answer `{"error": {"code", "message"}}`. */
export function fromResponse(status: number, body: string): TineError {
  let code = "internal";
  let message = body || `HTTP ${status}`;
  try {
    const err = (JSON.parse(body) as { error?: { code?: unknown; message?: unknown } }).error;
    if (err && typeof err.code === "string" && typeof err.message === "string") {
      code = err.code;
      message = err.message;
    }
  } catch {
    // Not JSON: the body itself is the message.
  }
  const Cls = BY_CODE[code] ?? Internal;
  return new Cls(code, message, status);
}
