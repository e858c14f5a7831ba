"""The completion log and feedback store: one SQL layer over SQLite (default) and PostgreSQL (by URL).

    completions  one row per served choice: (id, choice) -> the request, prompt and completion
                 token ids, behaviour logprobs, policy version per token, MoE routing, latency
    feedback     one row per rating event: event_id -> completion (id, choice), kind, value, text
    deployments  one row per decision of the online cycle (`strop.online.cycle`): the version served
                 after it, what it was (initial, promoted, refused, rollback), the feedback it
                 consumed up to, and its report (gates, monitors) as JSON

Durability: every write goes through one writer thread that commits a batch of whatever writes
are waiting in one transaction (group commit) and only then resolves their futures, so a caller
that waits for its future before answering its client never acknowledges anything a crash can
lose. SQLite runs in WAL mode with `synchronous=FULL` (the WAL is fsynced at every commit);
PostgreSQL with its default `synchronous_commit=on`. Many concurrent requests share one fsync.

A feedback event is stored once: a retry with the same `event_id` and the same content is a
`duplicate` (not counted again), one with other content is a `conflict`; an event for a
completion the log does not hold is `unknown`.

URLs: a path or `sqlite:///path` for SQLite; `postgresql://user@host:port/db` for PostgreSQL
(needs `psycopg`, the `postgres` extra).
"""

import json
import queue
import sqlite3
import threading
from concurrent.futures import Future
from dataclasses import astuple, dataclass, fields
from typing import Any, Callable

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS completions (
        id TEXT NOT NULL, choice INTEGER NOT NULL, created DOUBLE PRECISION NOT NULL, key_name TEXT,
        endpoint TEXT NOT NULL, model TEXT NOT NULL, request TEXT NOT NULL, prompt_ids TEXT NOT NULL,
        token_ids TEXT NOT NULL, logprobs TEXT NOT NULL, versions TEXT NOT NULL, routing TEXT,
        policy_version INTEGER NOT NULL, finish_reason TEXT NOT NULL, text TEXT NOT NULL,
        latency_s DOUBLE PRECISION NOT NULL, PRIMARY KEY (id, choice))""",
    """CREATE TABLE IF NOT EXISTS feedback (
        event_id TEXT PRIMARY KEY, completion_id TEXT NOT NULL, choice INTEGER NOT NULL, kind TEXT NOT NULL,
        value TEXT NOT NULL, text TEXT, key_name TEXT, created DOUBLE PRECISION NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS deployments (
        seq INTEGER PRIMARY KEY, created DOUBLE PRECISION NOT NULL, kind TEXT NOT NULL, version INTEGER NOT NULL,
        candidate INTEGER, through DOUBLE PRECISION NOT NULL, report TEXT NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS feedback_completion ON feedback (completion_id, choice)",
    "CREATE INDEX IF NOT EXISTS completions_version ON completions (policy_version)",
]
BATCH_MAX = 512  # writes committed together at most (bounds one transaction's size)


@dataclass
class CompletionRow:
    id: str
    choice: int
    created: float
    key_name: str | None
    endpoint: str  # "completions" or "chat"
    model: str
    request: dict[str, Any]
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    routing: list | None  # [positions, MoE layers, top_k] expert ids, or None for a dense model
    policy_version: int  # the version that produced the first generated token
    finish_reason: str
    text: str
    latency_s: float


JSON_COLUMNS = {"request", "prompt_ids", "token_ids", "logprobs", "versions", "routing", "report"}


@dataclass
class FeedbackRow:
    event_id: str
    completion_id: str
    choice: int
    kind: str
    value: str
    text: str | None
    key_name: str | None
    created: float


@dataclass
class DeploymentRow:
    seq: int  # 0, 1, 2, ... in the order of the decisions
    created: float
    kind: str  # "initial" | "promoted" | "refused" | "rollback"
    version: int  # the version served after this decision
    candidate: int | None  # the version trained and gated (promoted or refused); None otherwise
    through: float  # feedback created up to this time has been consumed by a cycle
    report: dict[str, Any]


@dataclass
class RatedCompletion:
    """A served completion with its latest rating."""

    completion: CompletionRow
    kind: str
    value: str
    rated: float  # when the rating was made


def _encode(row) -> tuple:
    return tuple(
        json.dumps(v) if f.name in JSON_COLUMNS and v is not None else v for f, v in zip(fields(row), astuple(row))
    )


def _decode(cls, values) -> Any:
    return cls(*(json.loads(v) if f.name in JSON_COLUMNS and v is not None else v for f, v in zip(fields(cls), values)))


class Store:
    """Writes through the group-committing writer thread; reads on a connection of their own."""

    def __init__(self, url: str):
        self.url = url
        self.postgres = url.startswith(("postgresql://", "postgres://"))
        if self.postgres:
            try:
                import psycopg  # noqa: F401
            except ImportError:
                raise ValueError("a PostgreSQL store needs psycopg: pip install 'strop[postgres]'") from None
        self.path = None if self.postgres else url.removeprefix("sqlite://")
        conn = self._connect()  # schema, and any connection error, here in the caller's thread
        try:
            cur = conn.cursor()
            for statement in SCHEMA:
                cur.execute(statement)
            conn.commit()
        finally:
            conn.close()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, name="strop-store-writer", daemon=True)
        self._thread.start()

    def _connect(self):
        if self.postgres:
            import psycopg

            try:
                return psycopg.connect(self.url)
            except psycopg.OperationalError as e:
                raise ValueError(f"cannot connect to {self.url}: {str(e).strip().splitlines()[0]}") from None
        try:
            conn = sqlite3.connect(self.path, timeout=30, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
        except sqlite3.Error as e:
            raise ValueError(f"cannot open SQLite store {self.path}: {e}") from None
        return conn

    def _sql(self, statement: str) -> str:
        return statement.replace("?", "%s") if self.postgres else statement

    # -- writes: queued, committed in batches by the writer thread --------------------------------

    def _submit(self, work: Callable[[Any], Any]) -> Future:
        fut: Future = Future()
        self._queue.put((work, fut))
        return fut

    def _write_loop(self) -> None:
        conn = self._connect()
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                batch = [item]
                while len(batch) < BATCH_MAX:
                    try:
                        nxt = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if nxt is None:
                        self._queue.put(None)  # stop after this batch
                        break
                    batch.append(nxt)
                cur = conn.cursor()
                try:
                    results = [work(cur) for work, _ in batch]
                    conn.commit()
                except Exception as e:  # a database failure fails every write of the batch, and nothing is acknowledged
                    conn.rollback()
                    for _, fut in batch:
                        fut.set_exception(e)
                    continue
                for (_, fut), result in zip(batch, results):
                    fut.set_result(result)
        finally:
            conn.close()

    def log_completions(self, rows: list[CompletionRow]) -> Future:
        """Record served choices; the future resolves once they are committed."""
        statement = self._sql(f"INSERT INTO completions VALUES ({', '.join('?' * len(fields(CompletionRow)))})")
        encoded = [_encode(r) for r in rows]

        def work(cur) -> None:
            cur.executemany(statement, encoded)

        return self._submit(work)

    def add_feedback(self, row: FeedbackRow) -> Future:
        """Record one rating; resolves to "added", "duplicate", "conflict" or "unknown" once committed."""
        exists = self._sql("SELECT 1 FROM completions WHERE id = ? AND choice = ?")
        insert = self._sql(
            f"INSERT INTO feedback VALUES ({', '.join('?' * len(fields(FeedbackRow)))}) "
            "ON CONFLICT (event_id) DO NOTHING"
        )
        stored = self._sql("SELECT completion_id, choice, kind, value, text FROM feedback WHERE event_id = ?")

        def work(cur) -> str:
            cur.execute(exists, (row.completion_id, row.choice))
            if cur.fetchone() is None:
                return "unknown"
            cur.execute(insert, _encode(row))
            if cur.rowcount == 1:
                return "added"
            cur.execute(stored, (row.event_id,))
            same = tuple(cur.fetchone()) == (row.completion_id, row.choice, row.kind, row.value, row.text)
            return "duplicate" if same else "conflict"

        return self._submit(work)

    def add_deployment(self, row: DeploymentRow) -> Future:
        """Record a decision of the online cycle; resolves once committed."""
        statement = self._sql(f"INSERT INTO deployments VALUES ({', '.join('?' * len(fields(DeploymentRow)))})")
        encoded = _encode(row)

        def work(cur) -> None:
            cur.execute(statement, encoded)

        return self._submit(work)

    def close(self) -> None:
        """Commit what is queued, then stop the writer."""
        self._queue.put(None)
        self._thread.join(timeout=60)

    # -- reads ------------------------------------------------------------------------------------

    def _read(self, statement: str, params: tuple = ()) -> list[tuple]:
        conn = self._connect()
        try:
            cur = conn.cursor()
            cur.execute(self._sql(statement), params)
            return [tuple(r) for r in cur.fetchall()]
        finally:
            conn.close()

    def completion(self, completion_id: str, choice: int = 0) -> CompletionRow | None:
        rows = self._read("SELECT * FROM completions WHERE id = ? AND choice = ?", (completion_id, choice))
        return _decode(CompletionRow, rows[0]) if rows else None

    def feedback(self) -> list[FeedbackRow]:
        return [_decode(FeedbackRow, r) for r in self._read("SELECT * FROM feedback ORDER BY created, event_id")]

    def deployments(self) -> list[DeploymentRow]:
        return [_decode(DeploymentRow, r) for r in self._read("SELECT * FROM deployments ORDER BY seq")]

    def rated(self, after: float, through: float, min_version: int, max_version: int) -> list[RatedCompletion]:
        """Completions of policy versions `min_version`..`max_version` with a rating made in (`after`,
        `through`], each with its latest rating (ties broken by event id)."""
        rows = self._read(
            "SELECT c.*, f.kind, f.value, f.created, f.event_id FROM feedback f JOIN completions c "
            "ON c.id = f.completion_id AND c.choice = f.choice "
            "WHERE f.created > ? AND f.created <= ? AND c.policy_version >= ? AND c.policy_version <= ? "
            "ORDER BY f.created, f.event_id",
            (after, through, min_version, max_version),
        )
        n = len(fields(CompletionRow))
        latest = {}
        for r in rows:
            latest[(r[0], r[1])] = RatedCompletion(_decode(CompletionRow, r[:n]), r[n], r[n + 1], r[n + 2])
        return list(latest.values())

    def completions_of(self, version: int, after: float, through: float) -> list[CompletionRow]:
        """Completions served by `version` in (`after`, `through`]."""
        return [
            _decode(CompletionRow, r)
            for r in self._read(
                "SELECT * FROM completions WHERE policy_version = ? AND created > ? AND created <= ? "
                "ORDER BY created, id, choice",
                (version, after, through),
            )
        ]

    def event_ids(self) -> set[str]:
        return {r[0] for r in self._read("SELECT event_id FROM feedback")}

    def count(self, table: str) -> int:
        assert table in ("completions", "feedback", "deployments")
        return int(self._read(f"SELECT COUNT(*) FROM {table}")[0][0])
