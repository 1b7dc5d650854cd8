"""The one error contract: every code has a status, every domain error is a StaleFlowError, the body
has one shape."""

from __future__ import annotations

import pytest

from staleflow.api.base import ServiceError
from staleflow.engines.base import EngineError
from staleflow.errors import HTTP_STATUS, ErrorCode, StaleFlowError
from staleflow.ledger import LedgerError
from staleflow.rewards import VerifierError
from staleflow.servers.manager.store import StoreError
from staleflow.servers.params import ParamsError
from staleflow.servers.trajectories.store import StoreConflict
from staleflow.transports.errors import ChecksumMismatch, FormatError


def test_every_code_has_one_status() -> None:
    assert set(HTTP_STATUS) == set(ErrorCode)
    assert all(400 <= status < 600 for status in HTTP_STATUS.values())


@pytest.mark.parametrize("error, code", [
    (LedgerError(ErrorCode.NOT_READY, "m", state="waiting"), ErrorCode.NOT_READY),
    (EngineError("duplicate_trajectory", "m"), ErrorCode.DUPLICATE_TRAJECTORY),
    (ParamsError(ErrorCode.UNKNOWN_VERSION, "m"), ErrorCode.UNKNOWN_VERSION),
    (StoreConflict("m"), ErrorCode.TRAJECTORY_CONFLICT),
    (StoreError("m"), ErrorCode.STORE_UNAVAILABLE),
    (VerifierError("m"), ErrorCode.INVALID_VERIFIER),
    (FormatError("m"), ErrorCode.INVALID_FORMAT),
    (ChecksumMismatch(0, "a", "b"), ErrorCode.CHECKSUM_MISMATCH),
])
def test_domain_errors_carry_codes_not_statuses(error: StaleFlowError, code: ErrorCode) -> None:
    assert isinstance(error, StaleFlowError) and error.code is code
    body = error.to_json()
    assert body["detail"] == "m" or "checksum" in body["detail"]
    assert body["code"] == code.value and error.status == HTTP_STATUS[code]


def test_an_unknown_code_is_refused_where_it_is_raised() -> None:
    with pytest.raises(ValueError):
        StaleFlowError("no_such_code", "m")


def test_clients_read_codes_as_members() -> None:
    known = ServiceError(409, "m", {"detail": "m", "code": "not_ready"})
    assert known.code is ErrorCode.NOT_READY
    assert ServiceError(409, "m", {"detail": "m", "code": "from_a_newer_peer"}).code is None
    assert ServiceError(502, "bad gateway").code is None
