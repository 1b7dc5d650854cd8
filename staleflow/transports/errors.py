"""What the transports raise: a format that cannot be stored or read, a chunk that does not
match its checksum, a shared-memory slot reused under a pull, a transport that cannot run here."""

from __future__ import annotations

from staleflow.errors import ErrorCode, StaleFlowError


class FormatError(StaleFlowError, ValueError):
    """A state dict, manifest or header that cannot be stored or read."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_FORMAT):
        super().__init__(code, message)


class ChecksumMismatch(FormatError):
    def __init__(self, chunk_index: int, expected: str, actual: str):
        super().__init__(f"chunk {chunk_index}: checksum {actual} does not match the expected {expected}",
                         ErrorCode.CHECKSUM_MISMATCH)
        self.chunk_index = chunk_index
        self.expected = expected
        self.actual = actual


class SlotReused(StaleFlowError):
    """A shared-memory pull saw its version's slot change generation: the PS gave the slot to
    another version while the pull read it. Nothing read since is handed out."""

    def __init__(self, version: int, generation: int, current: int | None):
        now = "the slot is gone" if current is None else f"generation {current}"
        super().__init__(ErrorCode.SLOT_REUSED,
                         f"version {version}: its shared-memory slot was given to another version while this pull read it "
                         f"({now}; the lease was granted under generation {generation}): the pull lease lapsed, so finish "
                         f"an shm pull within the PS's --lease-ttl or raise it; no torn tensor was returned, pull again")
        self.version = version
        self.generation = generation
        self.current = current


class TransportUnavailable(RuntimeError):
    """The transport cannot run here (a missing optional package, another host)."""
