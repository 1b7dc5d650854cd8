"""How a puller reads each holder (reference-oriented storage): shm from a holder on its host,
nixl where both sides have it, http otherwise; an explicit choice limits that to one transport
and http. The reference server hands every source's transports to the puller, and ranks a
holder on the puller's (possibly emulated) host in the ``host`` tier that shm needs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from staleflow.config import ParamsConfig
from staleflow.servers.params.reference import PS, ReferenceTable
from staleflow.transports.peer_reads import PEER_TRANSPORTS, peer_transport_for
from staleflow.transports.peers import ros_lease

TIERS = ("host", "zone", "other", "ps")
OFFERS = st.lists(st.sampled_from(["http", "shm", "nixl"]), unique=True).map(lambda rest: ["http", *rest] if "http" not in rest else rest)


@pytest.mark.parametrize(("choice", "tier", "offered", "nixl_here", "expected"), [
    ("auto", "host", ["http", "shm", "nixl"], True, "shm"),  # same host: shared memory first
    ("auto", "host", ["http", "nixl"], True, "nixl"),  # the holder offers no shm: nixl (cma locally)
    ("auto", "zone", ["http", "shm", "nixl"], True, "nixl"),  # another host: never shm
    ("auto", "other", ["http", "shm", "nixl"], False, "http"),  # no nixl here: http
    ("auto", "other", ["http", "shm"], True, "http"),  # no nixl there: http
    ("shm", "host", ["http", "shm", "nixl"], True, "shm"),
    ("shm", "other", ["http", "shm", "nixl"], True, "http"),  # shm asked for, the holder is elsewhere: http
    ("nixl", "host", ["http", "shm", "nixl"], True, "nixl"),  # nixl asked for on one host: nixl, not shm
    ("nixl", "host", ["http", "shm"], True, "http"),
    ("http", "host", ["http", "shm", "nixl"], True, "http"),
    ("auto", "ps", ["http"], True, "http"),  # the parameter server's own copy: over its data plane
])
def test_the_transport_for_a_source(choice: str, tier: str, offered: list[str], nixl_here: bool, expected: str) -> None:
    assert peer_transport_for(choice, tier, offered, nixl_here) == expected


@given(st.sampled_from(PEER_TRANSPORTS), st.sampled_from(TIERS), OFFERS, st.booleans())
def test_a_source_is_read_only_over_what_it_offers_shm_only_on_the_same_host_never_beyond_the_choice(
        choice: str, tier: str, offered: list[str], nixl_here: bool) -> None:
    via = peer_transport_for(choice, tier, offered, nixl_here)
    assert via in offered
    assert via != "shm" or tier == "host"
    assert via != "nixl" or nixl_here
    assert via in (choice, "http") or choice == "auto"


def test_an_unknown_choice_is_refused_with_the_ones_there_are() -> None:
    with pytest.raises(ValueError, match="auto, shm, nixl, http"):
        peer_transport_for("rdma", "host", ["http"], True)
    with pytest.raises(ValueError, match="auto, shm, nixl, http"):
        ros_lease({"version": 1, "chunk_bytes": 4096, "data_offset": 8, "tensors": [], "chunks": []}, "p", peers="rdma")
    with pytest.raises(ValueError, match="peer_transport"):
        ParamsConfig(peer_transport="rdma")  # type: ignore[arg-type]


def test_sources_carry_what_each_holder_serves_over_and_an_emulated_host_is_a_host_of_its_own() -> None:
    t = ReferenceTable(2, 2, 10.0)
    t.known(1, 4, ps_copy=True)
    t.heartbeat("here", "http://here", "boot-1", "", False, {1: None}, 0.0, ["http", "shm"])
    t.heartbeat("emulated", "http://emulated", "bench-host-3", "", False, {1: None}, 0.0, ["http", "shm", "nixl"])
    found = {s.holder_id: s for s in t.sources(1, 0, "puller", "boot-1", "", 1.0)}
    assert (found["here"].tier, found["here"].transports) == ("host", ("http", "shm"))
    assert (found["emulated"].tier, found["emulated"].transports) == ("other", ("http", "shm", "nixl"))
    assert found[PS].transports == ("http",)
    assert peer_transport_for("auto", found["emulated"].tier, found["emulated"].transports, False) == "http"
