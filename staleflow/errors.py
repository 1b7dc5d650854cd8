"""The error every StaleFlow component raises: ``StaleFlowError(code, message, **details)``.

Domain code (the ledger, engines, stores, verifiers) raises a stable ``ErrorCode``, never an HTTP
status. The services turn any ``StaleFlowError`` into the one error body of the wire,
``{"detail": message, "code": code, **details}``, with the status ``HTTP_STATUS`` gives the code;
clients read the code back with ``ErrorCode.parse`` and compare members, not strings.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class ErrorCode(StrEnum):
    """Stable, machine-readable reasons for a refusal; the wire carries the value."""

    # any request
    INVALID_REQUEST = "invalid_request"  # the body, path or query does not match the schema
    NOT_FOUND = "not_found"  # no such route
    METHOD_NOT_ALLOWED = "method_not_allowed"
    INTERNAL_ERROR = "internal_error"  # a bug: the service's log has the traceback
    BODY_TOO_LARGE = "body_too_large"
    UNAUTHORIZED = "unauthorized"  # a mutating request without the right bearer token
    TOO_MANY_CONNECTIONS = "too_many_connections"  # the server holds its limit of open connections: retry later
    UPSTREAM_ERROR = "upstream_error"  # a service this one depends on refused or failed
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"  # ... or could not be reached
    # the staleness ledger
    UNKNOWN_GROUP = "unknown_group"
    RETIRED_GROUP = "retired_group"
    DUPLICATE_GROUP = "duplicate_group"
    INVALID_GROUP = "invalid_group"
    NOT_ADMISSIBLE = "not_admissible"
    INVALID_STATUS = "invalid_status"
    GROUP_COMPLETE = "group_complete"
    INVALID_MEMBER = "invalid_member"
    NOT_READY = "not_ready"
    NOT_NEXT = "not_next"
    ALREADY_CONSUMED = "already_consumed"
    INVALID_VERSION = "invalid_version"
    UNKNOWN_BUFFER = "unknown_buffer"
    STORE_UNAVAILABLE = "store_unavailable"  # the durable store failed or is closed
    # rollout engines and the instance server
    DUPLICATE_TRAJECTORY = "duplicate_trajectory"
    INVALID_TRAJECTORY = "invalid_trajectory"
    VERSION_TOO_NEW = "version_too_new"
    VERSION_REGRESSION = "version_regression"
    EXCEEDS_KV_BUDGET = "exceeds_kv_budget"
    EXCEEDS_MAX_MODEL_LEN = "exceeds_max_model_len"
    INVALID_TOKEN = "invalid_token"
    INVALID_MODEL = "invalid_model"
    INVALID_WEIGHTS = "invalid_weights"
    WEIGHTS_LOAD_FAILED = "weights_load_failed"
    VLLM_MISSING = "vllm_missing"
    NOT_STARTED = "not_started"
    COMMAND_ID_REUSED = "command_id_reused"
    NOT_SIM = "not_sim"
    WRONG_CLOCK = "wrong_clock"
    TIME_BACKWARDS = "time_backwards"
    # the trajectory server
    UNKNOWN_TRAJECTORY = "unknown_trajectory"
    TRAJECTORY_CONFLICT = "trajectory_conflict"  # the request disagrees with the trajectory's state
    NOT_CONSUMED = "not_consumed"  # a batch asked for before its buffer was consumed
    BATCH_FREED = "batch_freed"  # ... or after the trainer freed it (its payloads are gone)
    # the parameter server
    UNKNOWN_VERSION = "unknown_version"
    VERSION_EXISTS = "version_exists"
    VERSION_TOO_OLD = "version_too_old"
    VERSION_BEING_PUSHED = "version_being_pushed"
    VERSION_INCOMPLETE = "version_incomplete"
    PUSH_IN_PROGRESS = "push_in_progress"
    UNKNOWN_PUSH = "unknown_push"
    PUSH_ID_MISMATCH = "push_id_mismatch"
    INVALID_PART = "invalid_part"  # a sharded push part that does not fit the version
    UNKNOWN_PART = "unknown_part"
    UNKNOWN_TABLE = "unknown_table"  # a push names its tensor table by digest, and this PS has not seen it
    PART_CONFLICT = "part_conflict"  # parts that overlap, leave bytes uncovered or disagree on the version
    MEMORY_FULL = "memory_full"  # no host memory for another version
    BUSY = "busy"  # being received or committed right now: retry later
    UNKNOWN_CHUNK = "unknown_chunk"
    CHUNK_LENGTH_MISMATCH = "chunk_length_mismatch"
    INCOMPLETE_CHUNK = "incomplete_chunk"
    MISSING_CHECKSUM = "missing_checksum"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    SLOT_REUSED = "slot_reused"  # a version's memory slot took another version while a pull read it
    INVALID_FORMAT = "invalid_format"
    UNKNOWN_LEASE = "unknown_lease"
    LEASE_MISMATCH = "lease_mismatch"
    TRANSPORT_DISABLED = "transport_disabled"
    TRANSPORT_UNAVAILABLE = "transport_unavailable"
    CLIENT_DISCONNECTED = "client_disconnected"
    # the reward server
    INVALID_VERIFIER = "invalid_verifier"
    BATCH_TOO_LARGE = "batch_too_large"
    # the coordinator
    UNKNOWN_INSTANCE = "unknown_instance"
    DUPLICATE_INSTANCE = "duplicate_instance"
    NO_SNAPSHOT = "no_snapshot"

    @classmethod
    def parse(cls, value: object) -> ErrorCode | None:
        """The member a reply's ``code`` names; None for a missing or unknown one (a newer peer)."""
        try:
            return cls(value)
        except ValueError:
            return None


_CONFLICT = 409
HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 422,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.INTERNAL_ERROR: 500,
    ErrorCode.BODY_TOO_LARGE: 413,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.TOO_MANY_CONNECTIONS: 503,
    ErrorCode.UPSTREAM_ERROR: 502,
    ErrorCode.UPSTREAM_UNAVAILABLE: 503,
    ErrorCode.UNKNOWN_GROUP: 404,
    ErrorCode.RETIRED_GROUP: _CONFLICT,
    ErrorCode.DUPLICATE_GROUP: _CONFLICT,
    ErrorCode.INVALID_GROUP: 422,
    ErrorCode.NOT_ADMISSIBLE: _CONFLICT,
    ErrorCode.INVALID_STATUS: _CONFLICT,
    ErrorCode.GROUP_COMPLETE: _CONFLICT,
    ErrorCode.INVALID_MEMBER: _CONFLICT,
    ErrorCode.NOT_READY: _CONFLICT,
    ErrorCode.NOT_NEXT: _CONFLICT,
    ErrorCode.ALREADY_CONSUMED: _CONFLICT,
    ErrorCode.INVALID_VERSION: 422,
    ErrorCode.UNKNOWN_BUFFER: 404,
    ErrorCode.STORE_UNAVAILABLE: 503,
    ErrorCode.DUPLICATE_TRAJECTORY: _CONFLICT,
    ErrorCode.INVALID_TRAJECTORY: 422,
    ErrorCode.VERSION_TOO_NEW: _CONFLICT,
    ErrorCode.VERSION_REGRESSION: _CONFLICT,
    ErrorCode.EXCEEDS_KV_BUDGET: 422,
    ErrorCode.EXCEEDS_MAX_MODEL_LEN: 422,
    ErrorCode.INVALID_TOKEN: 422,
    ErrorCode.INVALID_MODEL: 422,
    ErrorCode.INVALID_WEIGHTS: 422,
    ErrorCode.WEIGHTS_LOAD_FAILED: 422,
    ErrorCode.VLLM_MISSING: 422,
    ErrorCode.NOT_STARTED: 422,
    ErrorCode.COMMAND_ID_REUSED: _CONFLICT,
    ErrorCode.NOT_SIM: 404,
    ErrorCode.WRONG_CLOCK: _CONFLICT,
    ErrorCode.TIME_BACKWARDS: _CONFLICT,
    ErrorCode.UNKNOWN_TRAJECTORY: 404,
    ErrorCode.TRAJECTORY_CONFLICT: _CONFLICT,
    ErrorCode.NOT_CONSUMED: _CONFLICT,
    ErrorCode.BATCH_FREED: 410,
    ErrorCode.UNKNOWN_VERSION: 404,
    ErrorCode.VERSION_EXISTS: _CONFLICT,
    ErrorCode.VERSION_TOO_OLD: _CONFLICT,
    ErrorCode.VERSION_BEING_PUSHED: _CONFLICT,
    ErrorCode.VERSION_INCOMPLETE: _CONFLICT,
    ErrorCode.PUSH_IN_PROGRESS: _CONFLICT,
    ErrorCode.UNKNOWN_PUSH: 404,
    ErrorCode.PUSH_ID_MISMATCH: _CONFLICT,
    ErrorCode.INVALID_PART: 422,
    ErrorCode.UNKNOWN_PART: 404,
    ErrorCode.UNKNOWN_TABLE: 404,
    ErrorCode.PART_CONFLICT: _CONFLICT,
    ErrorCode.MEMORY_FULL: 503,
    ErrorCode.BUSY: _CONFLICT,
    ErrorCode.UNKNOWN_CHUNK: 404,
    ErrorCode.CHUNK_LENGTH_MISMATCH: 422,
    ErrorCode.INCOMPLETE_CHUNK: 422,
    ErrorCode.MISSING_CHECKSUM: 422,
    ErrorCode.CHECKSUM_MISMATCH: 422,
    ErrorCode.SLOT_REUSED: _CONFLICT,
    ErrorCode.INVALID_FORMAT: 422,
    ErrorCode.UNKNOWN_LEASE: 404,
    ErrorCode.LEASE_MISMATCH: 422,
    ErrorCode.TRANSPORT_DISABLED: 422,
    ErrorCode.TRANSPORT_UNAVAILABLE: 503,
    ErrorCode.CLIENT_DISCONNECTED: 400,
    ErrorCode.INVALID_VERIFIER: 422,
    ErrorCode.BATCH_TOO_LARGE: 413,
    ErrorCode.UNKNOWN_INSTANCE: 404,
    ErrorCode.DUPLICATE_INSTANCE: _CONFLICT,
    ErrorCode.NO_SNAPSHOT: 404,
}
"""The one code -> HTTP status table (every code has an entry; a unit test checks it)."""


class StaleFlowError(Exception):
    """A refusal with a stable ``code``, a message for people and optional JSON-able details."""

    def __init__(self, code: ErrorCode | str, message: str, **details: Any):
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
        self.details = details

    @property
    def status(self) -> int:
        return HTTP_STATUS[self.code]

    def to_json(self) -> dict[str, Any]:
        """The wire body: ``{"detail", "code", **details}``."""
        return error_body(self.code, self.message, **self.details)


def error_body(code: ErrorCode, message: str, **details: Any) -> dict[str, Any]:
    return {"detail": message, "code": code.value, **details}
