"""Fan-out over HTTP: the trainer's origin serves each delta once per cluster, to that
cluster's relay, which serves all of the cluster's engines.

Both ends speak the same two GET routes on a plain HTTP server:

    /head?after=N   long-poll: answers the latest version as soon as it is > N (or at timeout)
    /delta/V        the delta file taking V-1 to V

An `Origin` answers from a `Store` and counts its egress (bytes and deltas sent), which is the
number the design bounds: one copy per cluster per version. A `Relay` follows its upstream's
head, pulls each new delta exactly once (concurrent engine requests wait on the same pull),
keeps the last few in memory and serves them to its engines. Every response can be throttled
by a token bucket, so a topology on 127.0.0.1 behaves like links of a chosen bandwidth.
"""

import abc
import threading
import time
import urllib.request
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

from strop.sync.store import MissingPiece, Store

CHUNK = 64 * 1024
LONG_POLL_S = 10.0


class TokenBucket:
    """Send at most `rate` bytes/s on average, in bursts of at most `burst` bytes."""

    def __init__(self, rate: float, burst: int = CHUNK):
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.t = time.perf_counter()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.perf_counter()
            self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate) - n
            self.t = now
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Node(abc.ABC):
    """An HTTP endpoint serving /head and /delta from `latest()` and `delta(v)`; each
    connection (one link to one downstream node) gets its own token bucket."""

    def __init__(self, link_bytes_per_s: float | None):
        self.link_rate = link_bytes_per_s
        self.cond = threading.Condition()
        self.sent_bytes = 0
        self.sent_deltas = 0
        node = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet: one line per request is noise here
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                try:
                    if url.path == "/head":
                        after = int(parse_qs(url.query).get("after", ["-1"])[0])
                        body, is_delta = str(node.wait_newer(after)).encode(), False
                    elif url.path.startswith("/delta/"):
                        body, is_delta = node.delta(int(url.path.rsplit("/", 1)[1])), True
                    else:
                        return self.send_error(404)
                except MissingPiece as e:
                    return self.send_error(404, str(e))
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                bucket = TokenBucket(node.link_rate) if node.link_rate and is_delta else None
                for i in range(0, len(body), CHUNK):
                    if bucket:
                        bucket.take(min(CHUNK, len(body) - i))
                    self.wfile.write(body[i : i + CHUNK])
                if is_delta:
                    with node.cond:
                        node.sent_bytes += len(body)
                        node.sent_deltas += 1

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @abc.abstractmethod
    def latest(self) -> int:
        """The newest version this node can serve."""

    @abc.abstractmethod
    def delta(self, v: int) -> bytes:
        """The delta that produces version `v` from `v - 1`."""

    def wait_newer(self, after: int, timeout: float = LONG_POLL_S) -> int:
        with self.cond:
            self.cond.wait_for(lambda: self.latest() > after, timeout=timeout)
            return self.latest()

    def start(self):
        self.thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Origin(_Node):
    """The trainer's endpoint: serves deltas from the store. Call `notify()` after publishing."""

    def __init__(self, store: Store, link_bytes_per_s: float | None = None):
        self.store = store
        super().__init__(link_bytes_per_s)
        self._latest = store.head()["latest"]

    def latest(self) -> int:
        return self._latest

    def delta(self, v: int) -> bytes:
        return self.store.delta_bytes(v)

    def notify(self) -> None:
        with self.cond:
            self._latest = self.store.head()["latest"]
            self.cond.notify_all()


class Relay(_Node):
    """One per cluster: follows `upstream`, pulls each delta once, serves it to its engines."""

    def __init__(self, upstream: str, link_bytes_per_s: float | None = None, keep: int = 8):
        super().__init__(link_bytes_per_s)
        self.upstream = upstream
        self.keep = keep
        self.cache: OrderedDict[int, bytes] = OrderedDict()
        self.pulling: dict[int, threading.Event] = {}
        self.pulled_bytes = 0
        self._latest = int(get(f"{upstream}/head"))
        self._stop = threading.Event()
        self.follower = threading.Thread(target=self._follow, daemon=True)

    def start(self):
        super().start()
        self.follower.start()
        return self

    def close(self) -> None:
        self._stop.set()
        super().close()

    def latest(self) -> int:
        return self._latest

    def _follow(self) -> None:
        """Long-poll upstream; prefetch each new version before announcing it downstream, so
        engines asking for it are served from memory."""
        while not self._stop.is_set():
            try:
                head = int(get(f"{self.upstream}/head?after={self._latest}", timeout=LONG_POLL_S + 5))
            except OSError:
                if self._stop.wait(0.2):
                    return
                continue
            for v in range(self._latest + 1, head + 1):
                try:
                    self.delta(v)
                except MissingPiece:
                    pass  # engines asking for it get a 404 and repair from the store
            with self.cond:
                self._latest = max(self._latest, head)
                self.cond.notify_all()

    def delta(self, v: int) -> bytes:
        with self.cond:
            if v in self.cache:
                return self.cache[v]
            ev = self.pulling.get(v)
            mine = ev is None
            if mine:
                ev = self.pulling[v] = threading.Event()
        if not mine:  # someone is pulling it: wait, then read the cache
            ev.wait()
            with self.cond:
                if v in self.cache:
                    return self.cache[v]
            raise MissingPiece(f"relay could not pull delta {v}")
        try:
            body = get(f"{self.upstream}/delta/{v}")
        except OSError as e:
            with self.cond:
                self.pulling.pop(v, None)
            ev.set()  # waiters find no cache entry and fail too
            raise MissingPiece(f"relay could not pull delta {v}: {e}") from None
        with self.cond:
            self.cache[v] = body
            self.pulled_bytes += len(body)
            while len(self.cache) > self.keep:
                self.cache.popitem(last=False)
            self.pulling.pop(v, None)
        ev.set()
        return body


def get(url: str, timeout: float = 60.0) -> bytes:
    """GET a URL's body; raises OSError (urllib's errors are OSErrors) on failure."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def fetcher(relay_url: str):
    """`fetch(v)` for `Replica.advance`, through a relay; a failure is a MissingPiece, which the
    replica repairs from the store."""

    def fetch(v: int) -> bytes:
        try:
            return get(f"{relay_url}/delta/{v}")
        except OSError as e:
            raise MissingPiece(f"delta {v} not available from {relay_url}: {e}") from None

    return fetch
