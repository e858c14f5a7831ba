"""`strop bench feedback`: the feedback API of a real `strop serve` on loopback, per store backend.

For each backend (`sqlite`: a file; `postgres`: a real server started here, `strop.online.local_postgres`)
a `strop serve` process is started with an API key file and `--store`, a few completions are
served (ratings need completions to rate), then:

- sustained: `--connections` keep-alive connections each send `POST /v1/feedback` back to back
  for `--duration` seconds, every event new: `req_per_s` (acknowledged events a second) and
  latency percentiles (`p50_ms`, `p99_ms`, from sending a request to reading its whole answer);
- kill: the same burst again, and `kill -9` of the server `--kill-after` seconds into it. `acked`
  is the number of events answered 200 before the kill; `lost_after_kill` how many of those the
  database (opened afresh afterwards) does not hold. Events the server committed but could not
  acknowledge before dying are `committed_unacked` (a client retries them; idempotency counts them once).

The load generator is a minimal HTTP/1.1 client on raw asyncio streams in this process (cheaper
per request than any HTTP library), so the server, not the client, is what is measured; on a
shared machine both compete for cores, and the load average is recorded with the results.
"""

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

BACKENDS = ("sqlite", "postgres")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="about a minute: 3 s sustained, kill 1 s into the burst")
    p.add_argument("--duration", type=float, default=None, help="seconds of sustained load (default 20, --quick 3)")
    p.add_argument(
        "--kill-after",
        type=float,
        default=None,
        help="seconds into the second burst to kill -9 the server (default 3, --quick 1)",
    )
    p.add_argument("--connections", type=int, default=32, help="concurrent keep-alive connections")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated, some of: sqlite, postgres")
    p.add_argument("--json", help="write results to this JSON file")


def _tiny_checkpoint(path: Path) -> None:
    """A random tiny MoE policy and a tokenizer trained here: the server needs a model to serve,
    and the feedback path does not depend on which."""
    from strop.config import DataSection, ModelSection
    from strop.data.corpus import load_corpus
    from strop.data.tokenizer import train_tokenizer
    from strop.model.policy import build_model, save_model

    corpus = load_corpus(DataSection(val_files=5))
    tok = train_tokenizer(corpus.train[:100], vocab_size=512, sample_bytes=200_000)
    section = ModelSection(
        arch="qwen3_moe",
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        num_experts=8,
        experts_per_token=2,
        expert_size=16,
        dense_size=64,
        max_positions=512,
    )
    save_model(build_model(section, tok, seed=0), tok, path)


@contextlib.contextmanager
def _server(checkpoint: Path, keys: Path, store_url: str):
    """A `strop serve` process: yields (base URL, Popen)."""
    cmd = [
        sys.executable,
        "-m",
        "strop.cli",
        "serve",
        "--checkpoint",
        str(checkpoint),
        "--port",
        "0",
        "--threads",
        "1",
        "--keys",
        str(keys),
        "--store",
        store_url,
        "--name",
        "m",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if " on http://" not in line:
            raise RuntimeError(f"strop serve did not start: {line}{proc.stderr.read()[-2000:]}")
        yield line.split(" on ")[1].split()[0], proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


class Connection:
    """One keep-alive HTTP/1.1 connection sending JSON POSTs; answers are read whole."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, key: str):
        self.reader, self.writer = reader, writer
        self.head = (
            f"POST /v1/feedback HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\n"
        )

    async def post(self, body: bytes) -> int:
        self.writer.write(f"{self.head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next(int(h.split(b":", 1)[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:"))
        await self.reader.readexactly(length)
        return status


async def _burst(
    base: str,
    key: str,
    completion_ids: list[str],
    connections: int,
    seconds: float,
    acked: list[str],
    latencies: list[float],
    failures: dict,
) -> None:
    """Send new feedback events on every connection until `seconds` pass or the server dies."""
    host, port = base.removeprefix("http://").rsplit(":", 1)
    deadline = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        conn = Connection(*await asyncio.open_connection(host, int(port)), host, key)
        i = 0
        try:
            while time.perf_counter() < deadline:
                event_id = f"{w}-{i}-{uuid.uuid4().hex[:8]}"
                body = json.dumps(
                    {
                        "event_id": event_id,
                        "completion_id": completion_ids[i % len(completion_ids)],
                        "kind": "thumbs",
                        "value": "up" if i % 3 else "down",
                    }
                ).encode()
                t = time.perf_counter()
                try:
                    status = await conn.post(body)
                except (ConnectionError, asyncio.IncompleteReadError):
                    return  # the server is gone: this event was never acknowledged
                if status == 200:
                    acked.append(event_id)
                    latencies.append(time.perf_counter() - t)
                else:
                    failures[status] = failures.get(status, 0) + 1
                i += 1
        finally:
            conn.writer.close()

    await asyncio.gather(*(worker(w) for w in range(connections)))


def _pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else None


def _measure(backend: str, store_url: str, checkpoint: Path, keys: Path, key: str, args) -> dict:
    import httpx

    from strop.online.store import Store

    with _server(checkpoint, keys, store_url) as (base, proc):
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60) as c:
            completion_ids = [
                c.post("/v1/completions", json={"model": "m", "prompt": f"x = {i}", "max_tokens": 1}).json()["id"]
                for i in range(16)
            ]
        acked, latencies, failures = [], [], {}
        t0 = time.perf_counter()
        asyncio.run(_burst(base, key, completion_ids, args.connections, args.duration, acked, latencies, failures))
        elapsed = time.perf_counter() - t0
        killed, kill_lat, kill_failures = [], [], {}

        async def burst_and_kill() -> None:
            loop = asyncio.get_running_loop()
            loop.call_later(args.kill_after, os.kill, proc.pid, signal.SIGKILL)
            await _burst(
                base, key, completion_ids, args.connections, args.kill_after + 30, killed, kill_lat, kill_failures
            )

        asyncio.run(burst_and_kill())
        proc.wait()
    store = Store(store_url)  # a fresh connection: SQLite recovers its WAL here
    try:
        in_db = store.event_ids()
    finally:
        store.close()
    lost = [e for e in killed if e not in in_db]
    return {
        "req_per_s": len(acked) / elapsed,
        "p50_ms": _pct(latencies, 0.5),
        "p99_ms": _pct(latencies, 0.99),
        "requests": len(acked),
        "refused": failures,
        "acked": len(killed),
        "lost_after_kill": len(lost),
        "committed_unacked": len(in_db) - len(acked) - len(killed) + len(lost),
        "kill_refused": kill_failures,
        "killed_by": -proc.returncode if proc.returncode and proc.returncode < 0 else proc.returncode,
    }


def _postgres_or_reason(stack: contextlib.ExitStack) -> tuple[str | None, str | None]:
    from strop.online.local_postgres import NoPostgres, postgres_server

    try:
        import psycopg  # noqa: F401
    except ImportError:
        return None, "psycopg is not installed (pip install 'strop[postgres]')"
    try:
        return stack.enter_context(postgres_server()), None
    except NoPostgres as e:
        return None, str(e)


def run(args: argparse.Namespace) -> int:
    from strop.errors import UserError
    from strop.threads import set_threads

    set_threads(1)
    from strop.bench.table import format_table, write_json
    from strop.online.auth import KeyFile

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in BACKENDS for b in backends):
        raise UserError(f"--backends must be some of {', '.join(BACKENDS)}, got {args.backends!r}")
    if args.connections < 1:
        raise UserError(f"--connections must be at least 1, got {args.connections}")
    args.duration = args.duration or (3.0 if args.quick else 20.0)
    args.kill_after = args.kill_after or (1.0 if args.quick else 3.0)
    load = os.getloadavg()[0]
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="strop-bench-feedback-") as d, contextlib.ExitStack() as stack:
        root = Path(d)
        _tiny_checkpoint(root / "model")
        keys = KeyFile()
        key = keys.add("bench", ["infer", "feedback"], rate_per_s=1e9, burst=10**9)  # the limit is not what is measured
        keys.save(root / "keys.json")
        for backend in backends:
            if backend == "sqlite":
                url = str(root / "feedback.db")
            else:
                url, reason = _postgres_or_reason(stack)
                if url is None:
                    results[backend] = {"skipped": reason}
                    print(f"strop bench feedback: postgres skipped: {reason}", file=sys.stderr)
                    continue
            results[backend] = _measure(backend, url, root / "model", root / "keys.json", key, args)
    rows = [{"backend": b, **r} for b, r in results.items()]
    print(
        format_table(
            rows,
            [
                "backend",
                "req_per_s",
                "p50_ms",
                "p99_ms",
                "requests",
                "acked",
                "lost_after_kill",
                "committed_unacked",
                "skipped",
            ],
        )
    )
    write_json(
        args.json,
        {
            **results,
            "duration_s": args.duration,
            "kill_after_s": args.kill_after,
            "connections": args.connections,
            "loadavg_1m": load,
            "cpus": os.cpu_count(),
        },
    )
    return 0
