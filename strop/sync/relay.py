"""Fan-out over HTTP: the trainer's origin serves each delta once per cluster, to that
cluster's relay, which serves all of the cluster's engines.

Both ends speak the same two GET routes on a plain HTTP server:

    /head?after=N   long-poll: answers the latest version as soon as it is > N (or at timeout)
    /delta/V        the delta file taking V-1 to V

and the origin a third, for repairs:

    /tensor/V/NAME  one tensor at version V (safetensors bytes), rebuilt from the store, or, when
                    the store cannot (its own copy of a delta is damaged or gone), the trainer's
                    own copy of the latest version

An `Origin` answers from its trainer's `Publisher` and counts its egress (bytes and deltas sent,
per version), which is the number the design bounds: one copy per cluster per version. A `Relay`
follows its upstream's head, pulls each new delta exactly once (concurrent engine requests wait
on the same pull), keeps the last few in memory and serves them to its engines. Every response
can be throttled by a token bucket, so a topology on one machine behaves like links of a chosen
bandwidth. Servers bind `host` (127.0.0.1 by default; a Ray node's address across machines).
"""

import abc
import threading
import time
import urllib.request
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlparse

from strop.sync.store import MissingPiece, Publisher
from strop.sync.tensors import Tensor, from_bytes, to_bytes

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
    """An HTTP endpoint serving /head and /delta from `latest()` and `delta(v)` (and /tensor from
    `tensor(name, v)`); each response (a delta or a tensor to one downstream node) is paced by its
    own token bucket."""

    def __init__(self, link_bytes_per_s: float | None, host: str = "127.0.0.1"):
        self.link_rate = link_bytes_per_s
        self.cond = threading.Condition()
        self.sent_bytes = 0  # deltas and tensors
        self.sent_deltas = 0
        self.sent_by_version: Counter = Counter()  # version -> deltas sent
        self.sent_bytes_by_version: Counter = Counter()
        self.closing = False
        node = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet: one line per request is noise here
                pass

            def do_GET(self) -> None:
                url = urlparse(self.path)
                version, kind = None, "head"
                try:
                    if url.path == "/head":
                        after = int(parse_qs(url.query).get("after", ["-1"])[0])
                        body = str(node.wait_newer(after)).encode()
                    elif url.path.startswith("/delta/"):
                        version, kind = int(url.path.rsplit("/", 1)[1]), "delta"
                        body = node.delta(version)
                    elif url.path.startswith("/tensor/"):
                        _, _, v, name = url.path.split("/", 3)
                        kind, name = "tensor", unquote(name)
                        body = to_bytes({name: node.tensor(name, int(v))})
                    else:
                        return self.send_error(404)
                except MissingPiece as e:
                    return self.send_error(404, str(e).encode("ascii", "replace").decode())
                bucket = TokenBucket(node.link_rate) if node.link_rate and kind != "head" else None
                # Counted before the last byte leaves, so a receiver holding the whole body always
                # finds it in the stats; taken back if the receiver hangs up part way.
                self._count(kind, version, len(body), +1)
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    for i in range(0, len(body), CHUNK):
                        if bucket:
                            bucket.take(min(CHUNK, len(body) - i))
                        self.wfile.write(body[i : i + CHUNK])
                except (BrokenPipeError, ConnectionResetError):
                    self._count(kind, version, len(body), -1)
                    return  # the receiver gave up waiting (its timeout) and will ask again: nothing was sent

            def _count(self, kind: str, version: int | None, nbytes: int, sign: int) -> None:
                if kind == "head":
                    return
                with node.cond:
                    node.sent_bytes += sign * nbytes
                    if kind == "delta":
                        node.sent_deltas += sign
                        node.sent_by_version[version] += sign
                        node.sent_bytes_by_version[version] += sign * nbytes
                        if not node.sent_by_version[version]:
                            del node.sent_by_version[version], node.sent_bytes_by_version[version]

        self.server = _Server((host, 0), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @abc.abstractmethod
    def latest(self) -> int:
        """The newest version this node can serve."""

    @abc.abstractmethod
    def delta(self, v: int) -> bytes:
        """The delta that produces version `v` from `v - 1`."""

    def tensor(self, name: str, v: int) -> Tensor:
        """One tensor at version `v` (only the origin serves these)."""
        raise MissingPiece(f"{type(self).__name__} serves no tensors")

    def wait_newer(self, after: int, timeout: float = LONG_POLL_S) -> int:
        with self.cond:
            self.cond.wait_for(lambda: self.latest() > after or self.closing, timeout=timeout)
            return self.latest()

    def start(self):
        self.thread.start()
        return self

    def close(self) -> None:
        with self.cond:  # long polls answer now, so no client waits on a server that is going away
            self.closing = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()


class Origin(_Node):
    """The trainer's endpoint: serves what `publisher` published, from its store. Call `notify()`
    after publishing."""

    def __init__(self, publisher: Publisher, link_bytes_per_s: float | None = None, host: str = "127.0.0.1"):
        self.publisher, self.store = publisher, publisher.store
        super().__init__(link_bytes_per_s, host)
        self._latest = -1  # nothing to serve until the first `notify`

    def latest(self) -> int:
        return self._latest

    def delta(self, v: int) -> bytes:
        return self.store.delta_bytes(v)

    def tensor(self, name: str, v: int) -> Tensor:
        try:
            return self.store.tensor(name, v)
        except MissingPiece:
            version, state = self.publisher.latest()
            if v != version or name not in state:
                raise
            return state[name]

    def notify(self) -> None:
        with self.cond:
            self._latest = self.store.head()["latest"]
            self.cond.notify_all()


class Relay(_Node):
    """One per cluster: follows `upstream`, pulls each delta once, serves it to its engines."""

    def __init__(self, upstream: str, link_bytes_per_s: float | None = None, keep: int = 8, host: str = "127.0.0.1"):
        super().__init__(link_bytes_per_s, host)
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

    def pull(self, v: int) -> None:
        """Fetch version v now and announce it: for a caller that knows v was just published (the
        inline runtime, between two trainer steps, when the trainer's origin is idle and answers at
        once) rather than waiting for the long poll. A delta the origin cannot serve is announced
        all the same: engines asking for it get a MissingPiece and repair per tensor."""
        try:
            self.delta(v)
        except MissingPiece:
            pass
        with self.cond:
            self._latest = max(self._latest, v)
            self.cond.notify_all()

    def link(self) -> "RelayLink":
        """This relay as a receiver in its own process reaches it: direct calls, no HTTP."""
        return RelayLink(self.wait_newer, self.delta)

    def _follow(self) -> None:
        """Long-poll upstream; prefetch each new version (the last `keep` of them, after a gap)
        before announcing it downstream, so engines asking for it are served from memory."""
        while not self._stop.is_set():
            try:
                head = int(get(f"{self.upstream}/head?after={self._latest}", timeout=LONG_POLL_S + 5))
            except OSError:
                if self._stop.wait(0.2):
                    return
                continue
            for v in range(max(self._latest + 1, head - self.keep + 1), head + 1):
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


@dataclass(frozen=True)
class RelayLink:
    """How a receiver reaches its relay: `head(after)` long-polls for a version newer than `after`
    (answering the latest at timeout), `delta(v)` fetches one (a failure is a MissingPiece). Over
    HTTP (`http_link`) from another process; by direct calls (`Relay.link`) from the relay's own
    process, where every HTTP request would queue its client and its server thread for the GIL
    behind the engine and rollout threads (seconds of lag per version under load)."""

    head: Callable[[int], int]
    delta: Callable[[int], bytes]


def http_link(relay_url: str) -> RelayLink:
    return RelayLink(
        lambda after: int(get(f"{relay_url}/head?after={after}", timeout=LONG_POLL_S + 5)), fetcher(relay_url)
    )


def get(url: str, timeout: float = 60.0) -> bytes:
    """GET a URL's body; raises OSError (urllib's errors are OSErrors) on failure."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def fetcher(relay_url: str):
    """`fetch(v)` for `Replica.advance`, through a relay; a failure is a MissingPiece, which the
    replica repairs one tensor at a time."""

    def fetch(v: int) -> bytes:
        try:
            return get(f"{relay_url}/delta/{v}")
        except OSError as e:
            raise MissingPiece(f"delta {v} not available from {relay_url}: {e}") from None

    return fetch


def tensor_fetcher(origin_url: str):
    """`tensor(name, v)` for `Replica.advance`'s repairs, from the trainer's origin."""

    def tensor(name: str, v: int) -> Tensor:
        try:
            return from_bytes(get(f"{origin_url}/tensor/{v}/{quote(name, safe='')}"))[name]
        except OSError as e:
            raise MissingPiece(f"tensor {name!r} at version {v} not available from {origin_url}: {e}") from None

    return tensor
