"""Who may call the server, for what, and how often: API keys with scopes and per-key rate limits.

A key file (JSON) holds, per key, a name, the SHA-256 of the key, its scopes and its rate limit;
the key itself is shown once when it is made (`strop serve key`) and never stored. SHA-256 without
a salt or a slow KDF is enough here because keys are 256 random bits, not passwords: nothing can
be guessed from the hash faster than the key itself.

Scopes: `infer` (models, completions, chat, the weights version), `feedback` (`POST /v1/feedback`),
`admin` (weight updates and rollbacks). A scope grants only itself. `/health` needs no key; any
path not in `SCOPE_OF_PATH` needs `admin`, so a route added later is closed until it is listed.

`Guard` is ASGI middleware: a missing, malformed or unknown key is 401, a known key without the
path's scope is 403, a key over its rate is 429 with `Retry-After`; all before the body is read.
The caller's key name is put in `scope["state"]["key"]` for the completion log.
"""

import hashlib
import json
import math
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCOPES = ("infer", "feedback", "admin")
KEY_PREFIX = "strop_"
OPEN_PATHS = {"/health"}
SCOPE_OF_PATH = {
    "/v1/models": "infer",
    "/v1/completions": "infer",
    "/v1/chat/completions": "infer",
    "/weights/version": "infer",
    "/v1/feedback": "feedback",
    "/weights/update": "admin",
    "/weights/rollback": "admin",
}


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class KeyEntry:
    name: str
    sha256: str
    scopes: list[str]
    rate_per_s: float = 50.0  # sustained requests a second
    burst: int = 100  # requests allowed at once above the sustained rate


@dataclass
class KeyFile:
    """The keys a server accepts, as stored on disk (hashes only)."""

    keys: list[KeyEntry] = field(default_factory=list)

    @classmethod
    def load(cls, path: str | Path) -> "KeyFile":
        """Raises ValueError naming what is wrong (missing file, bad JSON, a bad entry)."""
        p = Path(path)
        if p.exists() and not p.is_file():  # a device or fifo would be read without end
            raise ValueError(f"key file {path} is not a regular file")
        try:
            raw = json.loads(p.read_text())
        except OSError as e:
            raise ValueError(f"cannot read key file {path}: {e.strerror or e}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"key file {path} is not JSON: {e}") from None
        try:
            keys = [KeyEntry(**k) for k in raw["keys"]]
        except (KeyError, TypeError) as e:
            raise ValueError(f'key file {path}: needs {{"keys": [{{name, sha256, scopes, ...}}]}} ({e})') from None
        for k in keys:
            check_entry(k)
        names = [k.name for k in keys]
        if len(set(names)) != len(names):
            raise ValueError(f"key file {path}: key names must be unique")
        return cls(keys)

    def save(self, path: str | Path) -> None:
        p = Path(path)
        p.write_text(json.dumps({"keys": [asdict(k) for k in self.keys]}, indent=1) + "\n")
        p.chmod(0o600)

    def add(self, name: str, scopes: list[str], rate_per_s: float = 50.0, burst: int = 100) -> str:
        """Add a new key; returns the key itself (the only time it exists outside the caller)."""
        if any(k.name == name for k in self.keys):
            raise ValueError(f"a key named {name!r} already exists")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        entry = KeyEntry(name, hash_key(key), sorted(set(scopes)), rate_per_s, burst)
        check_entry(entry)
        self.keys.append(entry)
        return key


def check_entry(k: KeyEntry) -> None:
    if not k.name or not isinstance(k.name, str):
        raise ValueError("a key needs a name")
    if not k.name.isprintable() or len(k.name) > 200:  # it is logged with every request: one line
        raise ValueError(f"key name {k.name[:200]!r} must be printable text on one line, at most 200 characters")
    if not k.scopes or any(s not in SCOPES for s in k.scopes):
        raise ValueError(f"key {k.name!r}: scopes must be some of {', '.join(SCOPES)}, got {k.scopes}")
    if not (isinstance(k.sha256, str) and len(k.sha256) == 64):
        raise ValueError(f"key {k.name!r}: sha256 must be 64 hex digits")
    rate_ok = isinstance(k.rate_per_s, (int, float)) and math.isfinite(k.rate_per_s) and k.rate_per_s > 0
    if not (rate_ok and isinstance(k.burst, int) and k.burst >= 1):  # (JSON has no infinity: the file must load)
        raise ValueError(f"key {k.name!r}: rate_per_s must be a finite number > 0 and burst an integer >= 1")


class TokenBucket:
    """`burst` requests at once, refilled at `rate` a second."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.tokens, self.at = float(burst), time.monotonic()

    def take(self) -> float:
        """0 when a request may go now, else the seconds until one may."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


class Guard:
    """ASGI middleware enforcing keys, scopes and rates (see the module docstring)."""

    def __init__(self, app, keys: KeyFile):
        self.app = app
        self.by_hash = {k.sha256: k for k in keys.keys}
        self.buckets = {k.name: TokenBucket(k.rate_per_s, k.burst) for k in keys.keys}
        self.lock = threading.Lock()  # buckets are shared by every request

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        kind, _, key = header.partition(" ")
        entry = self.by_hash.get(hash_key(key.strip())) if kind.lower() == "bearer" and key.strip() else None
        if entry is None:
            return await _refuse(
                send, 401, "a valid API key is required (Authorization: Bearer KEY)", [(b"www-authenticate", b"Bearer")]
            )
        need = SCOPE_OF_PATH.get(scope["path"], "admin")
        if need not in entry.scopes:
            return await _refuse(send, 403, f"key {entry.name!r} lacks the {need!r} scope this endpoint needs")
        with self.lock:
            wait = self.buckets[entry.name].take()
        if wait > 0:
            return await _refuse(
                send,
                429,
                f"key {entry.name!r} is over its rate of {entry.rate_per_s:g} requests/s",
                [(b"retry-after", str(math.ceil(wait)).encode())],
            )
        scope.setdefault("state", {})["key"] = entry.name
        return await self.app(scope, receive, send)


async def _refuse(send, status: int, message: str, headers: list | None = None) -> None:
    kind = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}[status]
    payload = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
