"""The finished-lengths feed (``GET /v1/finished-lengths``) of a real trajectory server over HTTP:
each completion once, in order, by a cursor that survives a restart of the server; a redelivered
completion adds nothing; only the newest ``finished_lengths_kept`` are kept, and a follower that
fell behind is told how many it missed. On SQLite and on PostgreSQL."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from support import manager_config

from staleflow.api.trajectories import FinishedLengthsOut, TrajectoryClient
from staleflow.config import LedgerConfig
from staleflow.servers.http import serve_in_thread
from staleflow.servers.manager import create_app as manager_app
from staleflow.servers.trajectories import SamplingConfig, TrajectoryServerConfig
from staleflow.servers.trajectories import create_app as ts_app

GROUP = 2


def _complete(ts: TrajectoryClient, lengths: dict[str, int]) -> int:
    """Route the trajectories to instance i0 at V_traj 0 and deliver their completions."""
    ts.checkout(instance_id="i0", assignments=[{"traj_id": t, "v_traj": 0} for t in lengths])
    items = [{"trajectory": {"traj_id": t, "tokens": [7] * n, "logprobs": [-0.5] * n, "finish_reason": "stop",
                             "segments": [{"version": 0, "start": 0, "end": n}]}} for t, n in lengths.items()]
    return ts.completed(instance_id="i0", items=items).accepted


def _follow(ts: TrajectoryClient, after: int, limit: int = 1000) -> FinishedLengthsOut:
    return ts.finished_lengths(after=after, limit=limit)


class Servers:
    """A manager and a trajectory server on one state directory; the TS can be restarted."""

    def __init__(self, stack: ExitStack, tmp_path: Path, kept: int, db_url: str | None = None):
        self.stack = stack
        manager = serve_in_thread(manager_app(manager_config(tmp_path, db_url, eta=1, batch_size=8, group_size=GROUP)))
        self.manager_url = stack.enter_context(manager).url
        self.config = TrajectoryServerConfig(ledger=LedgerConfig(eta=1, batch_size=8, group_size=GROUP),
                                             manager_url=self.manager_url, state_dir=tmp_path, db_url=db_url, reward="sim",
                                             sampling=SamplingConfig(max_tokens=64), finished_lengths_kept=kept)
        self.inner = ExitStack()
        stack.callback(self.inner.close)
        self.ts = self.start()

    def start(self) -> TrajectoryClient:
        server = self.inner.enter_context(serve_in_thread(ts_app(self.config)))
        return self.inner.enter_context(TrajectoryClient(server.url))

    def restart(self) -> TrajectoryClient:
        self.inner.close()
        self.inner = ExitStack()
        self.ts = self.start()
        return self.ts


def test_the_feed_gives_each_completion_once_across_a_restart_and_a_redelivery(tmp_path: Path,
                                                                               db_url: str | None) -> None:
    with ExitStack() as stack:
        servers = Servers(stack, tmp_path, kept=100, db_url=db_url)
        ts = servers.ts
        pending = ts.pending().trajectories
        by_group: dict[str, list[str]] = {}
        for p in pending:
            by_group.setdefault(p.group_id, []).append(p.traj_id)
            assert p.prompt_key, "every summary names its prompt"
        first, second = list(by_group.values())[:2]
        empty = _follow(ts, 0)
        assert (empty.lengths, empty.next, empty.skipped) == ([], 0, 0)

        assert _complete(ts, {first[0]: 5, first[1]: 9}) == 2
        page = _follow(ts, 0)
        assert [(x.traj_id, x.length) for x in page.lengths] == [(first[0], 5), (first[1], 9)]
        keys = {p.traj_id: p.prompt_key for p in pending}
        assert all(x.group_id == page.lengths[0].group_id and x.prompt_key == keys[x.traj_id] for x in page.lengths)
        cursor, epoch = page.next, page.epoch

        ts = servers.restart()
        assert _complete(ts, {first[0]: 5}) == 0, "a redelivered completion is not new"
        assert _complete(ts, {second[0]: 3}) == 1
        after_restart = _follow(ts, cursor)
        assert after_restart.epoch == epoch, "the feed is the same feed after a restart"
        assert [(x.traj_id, x.length) for x in after_restart.lengths] == [(second[0], 3)]
        assert after_restart.lengths[0].id > cursor and after_restart.skipped == 0
        assert [x.traj_id for x in _follow(ts, 0).lengths] == [first[0], first[1], second[0]], "nothing twice"
        paged = [_follow(ts, 0, limit=1), _follow(ts, 1, limit=1)]
        assert [p.lengths[0].traj_id for p in paged] == [first[0], first[1]] and paged[1].next == paged[1].lengths[0].id


def test_only_the_newest_lengths_are_kept_and_a_late_follower_learns_what_it_missed(tmp_path: Path,
                                                                                     db_url: str | None) -> None:
    with ExitStack() as stack:
        servers = Servers(stack, tmp_path, kept=3, db_url=db_url)
        ts = servers.ts
        trajs = [p.traj_id for p in ts.pending().trajectories][:5]
        for k, traj_id in enumerate(trajs):
            assert _complete(ts, {traj_id: 10 + k}) == 1
        page = _follow(ts, 0)
        assert [x.length for x in page.lengths] == [12, 13, 14], "the oldest two were pruned"
        assert page.skipped == 2 and page.next == page.lengths[-1].id
        assert _follow(ts, page.lengths[0].id).skipped == 0, "a follower within the window missed nothing"
        ts = servers.restart()
        assert [x.length for x in _follow(ts, 0).lengths] == [12, 13, 14]
        fresh = _follow(ts, page.next)
        assert (fresh.lengths, fresh.next, fresh.skipped) == ([], page.next, 0)


def test_a_bad_cursor_or_limit_is_refused_with_the_error_shape(tmp_path: Path) -> None:
    import httpx

    with ExitStack() as stack:
        servers = Servers(stack, tmp_path, kept=3)
        url = servers.ts.url
        for query in ("after=-1", f"after={2**63}", "limit=0", "limit=10001", "after=x"):
            reply = httpx.get(f"{url.rstrip('/')}/v1/finished-lengths?{query}")
            assert reply.status_code == 422 and reply.json()["code"] == "invalid_request", (query, reply.text)
