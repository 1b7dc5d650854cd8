"""Tables of the durable state (SQLAlchemy Core). Alembic migrations in ``migrations/`` create
and upgrade them; this module is the code's view of the same schema."""

from __future__ import annotations

from sqlalchemy import Column, Float, Index, Integer, LargeBinary, MetaData, String, Table, Text

metadata = MetaData()

ledger_settings = Table(
    "ledger_settings",
    metadata,
    Column("id", Integer, primary_key=True),  # a single row, id = 1
    Column("eta", Integer, nullable=False),
    Column("batch_size", Integer, nullable=False),
    Column("batch_redundancy", Float, nullable=False),
    Column("group_size", Integer, nullable=False),
    Column("group_redundancy", Float, nullable=False),
    Column("train_version", Integer, nullable=False),
    Column("sealed", Text, nullable=False),  # JSON list of group ids pinned to buffer t
    Column("created_at", Float, nullable=False),
)

ledger_entries = Table(
    "ledger_entries",
    metadata,
    Column("group_id", String(200), primary_key=True),
    Column("v_traj", Integer, nullable=False),
    Column("deadline", Integer, nullable=False),
    Column("status", String(16), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("occupied_seq", Integer, nullable=True),
    Column("completed", Text, nullable=False),  # JSON list of completed member ids
)

ledger_retired = Table(
    "ledger_retired",
    metadata,
    Column("group_id", String(200), primary_key=True),  # the primary key makes "once" structural
    Column("v_traj", Integer, nullable=False),
    Column("fate", String(16), nullable=False),
    Column("buffer", Integer, nullable=False),
    Column("retired_at", Float, nullable=False),
    Index("ix_ledger_retired_buffer", "buffer"),
)

ledger_events = Table(
    "ledger_events",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("at", Float, nullable=False),
    Column("op", String(32), nullable=False),
    Column("group_id", String(200), nullable=True),
    Column("buffer", Integer, nullable=True),
    Column("detail", Text, nullable=False),  # JSON
)

# --- trajectory server ------------------------------------------------------------------------

def _group_columns() -> list[Column]:
    """A prompt group's columns, live or archived."""
    return [
        Column("group_id", String(200), primary_key=True),
        Column("prompt_index", Integer, nullable=False),
        Column("prompt_text", Text, nullable=False),
        Column("answer", Text, nullable=False),
        Column("prompt_ids", LargeBinary, nullable=False),  # int32 little-endian
        Column("members", Integer, nullable=False),
        Column("needed", Integer, nullable=False),
        Column("v_traj", Integer, nullable=True),
        Column("state", String(16), nullable=False),
        Column("seq", Integer, nullable=False),
        Column("created_at", Float, nullable=False),
    ]


def _trajectory_columns() -> list[Column]:
    """A trajectory's columns, live or archived."""
    return [
        Column("traj_id", String(200), primary_key=True),
        Column("group_id", String(200), nullable=False),
        Column("state", String(16), nullable=False),
        Column("instance_id", String(200), nullable=True),
        Column("tokens", LargeBinary, nullable=False),  # int32 little-endian
        Column("logprobs", LargeBinary, nullable=False),  # float32 little-endian
        Column("segments", Text, nullable=False),  # JSON [[version, start, end], ...]
        Column("finish_reason", String(16), nullable=True),
        Column("reward", Float, nullable=True),
        Column("reward_reason", Text, nullable=True),
        Column("seq", Integer, nullable=False),
        Column("updated_at", Float, nullable=False),
        Column("carried", Text, nullable=True),  # JSON {field: value}: the response's other fields (null: none)
    ]


ts_groups = Table("ts_groups", metadata, *_group_columns(), Index("ix_ts_groups_state", "state"))

ts_trajectories = Table("ts_trajectories", metadata, *_trajectory_columns(),
                        Index("ix_ts_trajectories_group", "group_id"))

ts_meta = Table(
    "ts_meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

# finished groups and their members leave the live tables above for these append-only ones
# (``trajectories.retention: archive``); the live tables stay the size of the working set

ts_groups_archive = Table("ts_groups_archive", metadata, *_group_columns(),
                          Column("archived_at", Float, nullable=False))

ts_trajectories_archive = Table("ts_trajectories_archive", metadata, *_trajectory_columns(),
                                Column("archived_at", Float, nullable=False),
                                Index("ix_ts_trajectories_archive_group", "group_id"))

# counts of the ledger events compacted away, by op (the ledger's statistics survive compaction)
ledger_event_counts = Table(
    "ledger_event_counts",
    metadata,
    Column("op", String(32), primary_key=True),
    Column("count", Integer, nullable=False),
)

# groups retired, by fate, kept with each retirement: the ledger's statistics without counting
# ``ledger_retired``, which holds every group of the run
ledger_retired_counts = Table(
    "ledger_retired_counts",
    metadata,
    Column("fate", String(16), primary_key=True),
    Column("count", Integer, nullable=False),
)

ts_progress = Table(
    "ts_progress",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("traj_id", String(200), nullable=False),
    Column("instance_id", String(200), nullable=False),
    Column("start", Integer, nullable=False),  # the response position of the first token
    Column("tokens", LargeBinary, nullable=False),  # int32 little-endian
    Column("logprobs", LargeBinary, nullable=False),  # float32 little-endian
    Column("segments", Text, nullable=False),  # JSON [[version, start, end], ...] of the whole response so far
    Column("at", Float, nullable=False),
    Index("ix_ts_progress_traj", "traj_id"),
)

# the lengths of finished (completed) trajectories, appended in the completion's transaction: the
# coordinator's length predictor follows them by id (``GET /v1/finished-lengths?after=``); only the
# newest ``finished_lengths_kept`` rows stay, so the table is bounded whatever the run's length
ts_finished_lengths = Table(
    "ts_finished_lengths",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("traj_id", String(200), nullable=False),
    Column("group_id", String(200), nullable=False),
    Column("prompt_key", String(32), nullable=False),  # the same prompt sampled again has the same key
    Column("length", Integer, nullable=False),  # response tokens
    Column("at", Float, nullable=False),
    sqlite_autoincrement=True,  # an id is never used twice, even after the oldest rows were pruned
)
