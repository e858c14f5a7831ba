"""Serving that is safe to expose: API keys hashed at rest, scopes (401 / 403), per-key rate limits,
weight updates and rollbacks only to versions of the run's own store (a path is refused), and
`strop serve` refusing to listen beyond loopback without keys. A real server on a free port."""

import contextlib
import json

import httpx
import pytest
import torch

from strop.cli import main
from strop.engine.engine import Engine
from strop.engine.server import serve_in_thread
from strop.model.policy import build_model, save_model
from strop.online.app import create_serving_app
from strop.online.auth import KeyFile, hash_key
from strop.online.store import Store
from strop.online.versions import Versions
from strop.sync.apply import bits_view
from strop.sync.store import Publisher
from strop.sync.store import Store as WeightStore
from tests.conftest import tiny_model_section


def publish_versions(engine: Engine, root: str, n: int) -> list[dict[str, torch.Tensor]]:
    """Versions 0..n-1 of the engine's weights in a weight store: 0 as served, then perturbed (a tied
    tensor, held under two names, perturbed once)."""
    torch.manual_seed(0)
    publisher = Publisher(WeightStore(root))
    states = []
    for v in range(n):
        new: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            state = {
                k: new.setdefault(id(t), (t + 0.01 * torch.randn_like(t) if v else t.clone()).contiguous())
                for k, t in engine.named_tensors().items()
            }
        publisher.publish({k: bits_view(t) for k, t in state.items()}, version=v)
        states.append(state)
    return states


@contextlib.contextmanager
def secure_server(tokenizer, keys: KeyFile | None, store: Store | None = None, versions: Versions | None = None):
    """A tiny MoE engine behind the app `strop serve` exposes, on a free port: yields (url, engine)."""
    model = build_model(tiny_model_section("qwen3_moe"), tokenizer, seed=0).eval()
    engine = Engine(model, tokenizer, max_batch=4, max_len=128)
    url, stop = serve_in_thread(engine, "tiny", app=create_serving_app(engine, "tiny", keys, store, versions))
    try:
        yield url, engine
    finally:
        stop()


@pytest.fixture
def keys():
    k = KeyFile()
    made = {s: k.add(s, [s]) for s in ("infer", "feedback", "admin")}
    made["slow"] = k.add("slow", ["infer"], rate_per_s=0.5, burst=2)
    return k, made


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def same_weights(engine: Engine, state: dict[str, torch.Tensor]) -> bool:
    live = engine.named_tensors()
    return all(torch.equal(live[k], t.to(live[k].dtype)) for k, t in state.items())


def test_key_file_keeps_only_hashes(tmp_path, capsys):
    path = tmp_path / "keys.json"
    assert main(["serve", "key", "--keys", str(path), "--name", "ci", "--scopes", "infer,feedback"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("strop_") and key not in path.read_text()
    loaded = KeyFile.load(path)
    assert loaded.keys[0].sha256 == hash_key(key) and loaded.keys[0].scopes == ["feedback", "infer"]
    assert path.stat().st_mode & 0o077 == 0  # readable by its owner only
    assert main(["serve", "key", "--keys", str(path), "--name", "ci", "--scopes", "infer"]) == 2  # names are unique
    assert main(["serve", "key", "--keys", str(path), "--name", "x", "--scopes", "root"]) == 2
    assert "scopes must be some of" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text(json.dumps({"keys": [{"name": "x", "sha256": "00", "scopes": ["infer"]}]}))
    with pytest.raises(ValueError, match="64 hex"):
        KeyFile.load(tmp_path / "bad.json")


def test_missing_unknown_and_wrongly_scoped_keys(tiny_tokenizer, tmp_path, keys):
    k, made = keys
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    with secure_server(tiny_tokenizer, k, Store(str(tmp_path / "log.db"))) as (url, _), httpx.Client() as c:
        assert c.get(url + "/health").status_code == 200  # the one open path
        for headers in (
            {},
            auth("strop_not-a-key"),
            {"Authorization": "Basic " + made["infer"]},
            {"Authorization": "Bearer"},
        ):
            r = c.post(url + "/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", headers
            assert r.json()["error"]["type"] == "authentication_error"
        assert c.post(url + "/v1/completions", json=body, headers=auth(made["infer"])).status_code == 200
        refused = [
            ("/v1/completions", "feedback"),
            ("/v1/chat/completions", "admin"),
            ("/v1/feedback", "infer"),
            ("/weights/update", "infer"),
            ("/weights/rollback", "feedback"),
            ("/not/listed", "infer"),
        ]
        for path, scope in refused:
            r = c.post(url + path, json={}, headers=auth(made[scope]))
            assert r.status_code == 403 and "scope" in r.json()["error"]["message"], (path, scope)
        assert c.get(url + "/v1/models", headers=auth(made["admin"])).status_code == 403  # admin grants only admin


def test_rate_limit_per_key(tiny_tokenizer, tmp_path, keys):
    k, made = keys
    with secure_server(tiny_tokenizer, k) as (url, _), httpx.Client() as c:
        codes = [c.get(url + "/v1/models", headers=auth(made["slow"])).status_code for _ in range(3)]
        assert codes == [200, 200, 429]
        r = c.get(url + "/v1/models", headers=auth(made["slow"]))
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert c.get(url + "/v1/models", headers=auth(made["infer"])).status_code == 200  # other keys unaffected


def test_weights_move_only_between_versions_of_the_store(tiny_tokenizer, tmp_path, keys):
    k, made = keys
    with contextlib.ExitStack() as stack:
        model = build_model(tiny_model_section("qwen3_moe"), tiny_tokenizer, seed=0).eval()
        engine = Engine(model, tiny_tokenizer, max_batch=4, max_len=128)
        states = publish_versions(engine, str(tmp_path / "weights"), 3)
        versions = Versions(str(tmp_path / "weights"))
        url, stop = serve_in_thread(engine, "tiny", app=create_serving_app(engine, "tiny", k, None, versions))
        stack.callback(stop)
        c = stack.enter_context(httpx.Client(headers=auth(made["admin"]), timeout=60))
        original = {n: t.clone() for n, t in engine.named_tensors().items()}
        save_model(
            build_model(tiny_model_section("qwen3_moe"), tiny_tokenizer, seed=5), tiny_tokenizer, tmp_path / "evil"
        )
        for body in (
            {"path": str(tmp_path / "evil")},
            {"path": str(tmp_path / "evil"), "version": 1},
            {"version": "../evil"},
            {"version": 1, "from": "/etc/passwd"},
        ):
            r = c.post(url + "/weights/update", json=body)
            assert r.status_code == 400, body
        r = c.post(url + "/weights/update", json={"path": "/etc/passwd"})
        assert "never a path" in r.json()["error"]["message"]
        assert c.post(url + "/weights/rollback", json={"path": str(tmp_path / "evil")}).status_code == 400
        assert same_weights(engine, original) and engine.version == 0

        assert c.post(url + "/weights/update", json={"version": 7}).status_code == 404
        r = c.post(url + "/weights/update", json={"version": 2})
        assert r.status_code == 200 and r.json()["version"] == 2 and same_weights(engine, states[2])
        assert c.post(url + "/weights/update", json={"version": 1}).status_code == 400  # going back is a rollback
        r = c.post(url + "/weights/rollback", json={"to": 0})
        assert r.status_code == 200 and engine.version == 0
        assert all(torch.equal(engine.named_tensors()[n], t) for n, t in original.items())  # bit for bit
        infer = httpx.post(
            url + "/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 2},
            headers=auth(made["infer"]),
            timeout=60,
        )
        assert infer.json()["choices"][0]["policy_versions"] == [0, 0]
        assert c.post(url + "/weights/rollback", json={"to": 1}).status_code == 400  # not older than the served 0


def test_serve_needs_keys_beyond_loopback(tiny_policy_dir, tmp_path, capsys):
    args = ["serve", "--checkpoint", str(tiny_policy_dir), "--port", "0"]
    assert main(args + ["--host", "0.0.0.0"]) == 2
    assert "needs --keys" in capsys.readouterr().err
    (tmp_path / "keys.json").write_text("{not json")
    assert main(args + ["--keys", str(tmp_path / "keys.json")]) == 2
    assert "not JSON" in capsys.readouterr().err
