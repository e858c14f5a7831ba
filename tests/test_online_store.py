"""The completion log and feedback API on both backends: SQLite, and a real PostgreSQL server these
tests start themselves (`strop.online.local_postgres`; skipped, saying why, where none can run).
Every served completion is logged with what RL needs; ratings are validated, idempotent, and
answered with clear 4xx codes."""

import uuid

import httpx
import pytest

from strop.online.local_postgres import NoPostgres, postgres_server
from strop.online.store import CompletionRow, FeedbackRow, Store
from tests.test_online_serving import secure_server


@pytest.fixture(scope="module")
def postgres_url():
    try:
        import psycopg  # noqa: F401
    except ImportError:
        pytest.skip("psycopg is not installed (pip install -e '.[dev]')")
    try:
        with postgres_server() as url:
            yield url
    except NoPostgres as e:
        pytest.skip(f"no PostgreSQL server can run here: {e}")


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request, tmp_path):
    """A fresh, empty store of each backend (PostgreSQL: a new database on the module's server)."""
    if request.param == "sqlite":
        yield str(tmp_path / "log.db")
        return
    import psycopg

    server = request.getfixturevalue("postgres_url")
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield server.replace("/postgres?", f"/{name}?")


def row(cid: str = "cmpl-1", choice: int = 0) -> CompletionRow:
    return CompletionRow(
        cid,
        choice,
        1.5,
        "alice",
        "chat",
        "tiny",
        {"messages": [{"role": "user", "content": "hé"}]},
        [1, 2, 3],
        [4, 5],
        [-0.25, -1.5],
        [3, 3],
        [[[0, 1]], [[2, 3]]],
        3,
        "stop",
        "ok",
        0.01,
    )


def test_store_round_trip_and_idempotent_feedback(store_url):
    store = Store(store_url)
    try:
        store.log_completions([row(), row(choice=1)]).result(30)
        assert store.completion("cmpl-1", 1) == row(choice=1) and store.completion("nope") is None
        event = FeedbackRow("e1", "cmpl-1", 0, "thumbs", "up", None, "alice", 2.0)
        statuses = [store.add_feedback(event).result(30) for _ in range(3)]
        assert statuses == ["added", "duplicate", "duplicate"]
        changed = FeedbackRow("e1", "cmpl-1", 0, "thumbs", "down", None, "alice", 3.0)
        assert store.add_feedback(changed).result(30) == "conflict"
        assert (
            store.add_feedback(FeedbackRow("e2", "cmpl-9", 0, "edit", "kept", None, None, 2.0)).result(30) == "unknown"
        )
        many = [
            store.add_feedback(FeedbackRow(f"m{i}", "cmpl-1", 1, "accept", "reject", "x", None, 4.0)) for i in range(50)
        ]  # queued at once: committed together
        assert all(f.result(30) == "added" for f in many)
        assert store.count("feedback") == 51 and store.feedback()[0] == event
    finally:
        store.close()


def test_served_completions_are_logged_and_rated(tiny_tokenizer, store_url):
    store = Store(store_url)
    try:
        with secure_server(tiny_tokenizer, None, store) as (url, _), httpx.Client(base_url=url, timeout=60) as c:
            r = c.post(
                "/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": "def f(x):",
                    "max_tokens": 4,
                    "n": 2,
                    "logprobs": 1,
                    "return_routed_experts": True,
                },
            ).json()
            for i, choice in enumerate(r["choices"]):
                logged = store.completion(r["id"], i)  # committed before the response came back
                assert logged.token_ids == choice["token_ids"] and logged.prompt_ids == choice["prompt_token_ids"]
                assert logged.logprobs == choice["logprobs"]["token_logprobs"]
                assert logged.routing == choice["routed_experts"] and logged.versions == choice["policy_versions"]
                assert logged.policy_version == 0 and logged.latency_s > 0 and logged.text == choice["text"]
                assert logged.request["prompt"] == "def f(x):" and logged.endpoint == "completions"
            chat = c.post(
                "/v1/chat/completions",
                json={"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
            ).json()
            assert store.completion(chat["id"]).request["messages"][0]["content"] == "hi"
            with c.stream(
                "POST", "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3, "stream": True}
            ) as s:
                first = next(line for line in list(s.iter_lines()) if line.startswith("data: {"))
            streamed_id = first.split('"id": "')[1].split('"')[0]
            assert len(store.completion(streamed_id).token_ids) == 3

            event = {
                "event_id": "ev-1",
                "completion_id": r["id"],
                "choice": 1,
                "kind": "edit",
                "value": "kept",
                "text": "good refactor",
            }
            assert c.post("/v1/feedback", json=event).json() == {"event_id": "ev-1", "status": "added"}
            assert c.post("/v1/feedback", json=event).json()["status"] == "duplicate"  # a retry counts once
            assert c.post("/v1/feedback", json={**event, "value": "reverted"}).status_code == 409
            assert (
                c.post("/v1/feedback", json={**event, "event_id": "ev-2", "completion_id": "cmpl-nope"}).status_code
                == 404
            )
            assert c.post("/v1/feedback", json={**event, "event_id": "ev-3", "choice": 5}).status_code == 404
            bad = [
                {**event, "kind": "stars"},
                {**event, "value": "up"},
                {**event, "score": 5},
                {k: v for k, v in event.items() if k != "event_id"},
                {**event, "text": "x" * 5000},
                {**event, "choice": -1},
                {**event, "event_id": ""},
            ]
            for body in bad:
                resp = c.post("/v1/feedback", json=body)
                assert resp.status_code == 400 and resp.json()["error"]["message"], body
            assert (
                c.post("/v1/feedback", content=b"{nope", headers={"content-type": "application/json"}).status_code
                == 400
            )
            thumbs = {"event_id": "ev-4", "completion_id": chat["id"], "kind": "thumbs", "value": "down"}
            assert c.post("/v1/feedback", json=thumbs).status_code == 200
        assert [(f.event_id, f.value) for f in store.feedback()] == [("ev-1", "kept"), ("ev-4", "down")]
        assert store.count("completions") == 4
    finally:
        store.close()


def test_an_unreachable_database_is_a_clear_error(tmp_path):
    pytest.importorskip("psycopg")
    with pytest.raises(ValueError, match="cannot connect"):
        Store(f"postgresql://nobody@/postgres?host={tmp_path}")
    with pytest.raises(ValueError, match="cannot open"):
        Store(str(tmp_path / "no" / "such" / "dir.db"))
