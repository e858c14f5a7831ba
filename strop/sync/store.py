"""A versioned store of weights: one snapshot, then a chain of deltas, each with a manifest.

Layout under the root (a local directory, or any `fsspec` URL such as `s3://bucket/run` or
`memory://run`):

    HEAD.json                      {"latest": v, "snapshot": s}
    snapshots/00000000.safetensors the only full copy: version 0, or the GC point
    deltas/00000007.delta          version 6 -> 7 (`codec` format)
    manifests/00000007.json        version, base version, bytes, per-tensor [dtype, shape, crc32]
    deltas/00000007.p1.delta       a sharded trainer's version: rank 1's piece (`pieces`); the
    snapshots/00000000.p1.safetensors  manifest counts them, and holds the whole tensors' crcs
    files/INDEX.json, files/<name> small files that go with the weights (a policy's config and
                                   tokenizer, for engines that start from the store): bytes as put

The trainer side is `Publisher.publish(state, version)`. A receiver at version u reaches v with
`advance`, applying deltas u+1..v. A damaged piece never costs a whole model: a delta that
is missing, truncated or corrupt is repaired by fetching just the tensors it failed to
deliver, each rebuilt at full precision by `Store.tensor` from the snapshot and that tensor's
own entries in the deltas (ranged reads). There are no scheduled full snapshots: `Store.gc`
folds the oldest deltas into a new snapshot *inside the store* and deletes them; receivers
behind it jump by fetching only the tensors whose checksums differ from theirs.
"""

import json
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
import numpy as np

from strop.sync import codec, pieces
from strop.sync.tensors import StateDict, Tensor, bits_dtype, from_bytes, save, to_bytes

FILE_INDEX = "INDEX.json"  # under files/: the names `put_files` kept


class MissingPiece(LookupError):
    """The store cannot deliver what was asked (a version or tensor that is gone or broken)."""


@dataclass
class Manifest:
    version: int
    base_version: int | None  # None for a snapshot
    nbytes: int  # size of the delta (or snapshot) file; of all its pieces
    tensors: dict[str, tuple[str, tuple[int, ...], int]]  # name -> dtype, shape, crc32
    pieces: int = 0  # published in this many pieces (`strop.sync.pieces`, one per rank); 0: one file

    def crcs(self) -> dict[str, int]:
        return {k: v[2] for k, v in self.tensors.items()}

    def to_json(self) -> bytes:
        j = {
            "version": self.version,
            "base_version": self.base_version,
            "bytes": self.nbytes,
            "tensors": {k: [d, list(s), c] for k, (d, s, c) in self.tensors.items()},
        }
        return json.dumps({**j, "pieces": self.pieces} if self.pieces else j).encode()

    @classmethod
    def from_json(cls, b: bytes) -> "Manifest":
        j = json.loads(b)
        tensors = {k: (d, tuple(s), c) for k, (d, s, c) in j["tensors"].items()}
        return cls(j["version"], j["base_version"], j["bytes"], tensors, j.get("pieces", 0))


def manifest_of(
    state: StateDict, crcs: dict[str, int], version: int, base_version: int | None, nbytes: int
) -> Manifest:
    return Manifest(version, base_version, nbytes, {k: (t.dtype, t.shape, crcs[k]) for k, t in sorted(state.items())})


class Store:
    def __init__(self, root: str):
        self.fs, self.root = fsspec.core.url_to_fs(root)
        self.root = self.root.rstrip("/")

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _delta_path(self, v: int, piece: int | None = None) -> str:
        return self._path("deltas", f"{v:08d}.delta" if piece is None else f"{v:08d}.p{piece}.delta")

    def _snapshot_path(self, v: int, piece: int | None = None) -> str:
        return self._path("snapshots", f"{v:08d}.safetensors" if piece is None else f"{v:08d}.p{piece}.safetensors")

    def _paths(self, kind: str, v: int, m: Manifest) -> list[str]:
        """The files holding version v: one, or its pieces."""
        path = self._delta_path if kind == "deltas" else self._snapshot_path
        return [path(v, i) for i in range(m.pieces)] if m.pieces else [path(v)]

    def _manifest_path(self, v: int) -> str:
        return self._path("manifests", f"{v:08d}.json")

    def _write(self, path: str, data: bytes) -> None:
        """Write then rename, so a reader never sees half a file under the final name."""
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(path + ".tmp", data)
        self.fs.mv(path + ".tmp", path)

    def _read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        try:
            return self.fs.cat_file(path, start=start, end=end)
        except FileNotFoundError:
            raise MissingPiece(f"{path} is missing from the store") from None

    # -- what the store holds

    def head(self) -> dict[str, int]:
        if not self.fs.exists(self._path("HEAD.json")):
            raise MissingPiece(f"no weights published under {self.root}")
        return json.loads(self._read(self._path("HEAD.json")))

    def manifest(self, v: int) -> Manifest:
        return Manifest.from_json(self._read(self._manifest_path(v)))

    def delta_bytes(self, v: int) -> bytes:
        """The delta file taking version v-1 to v; for a version in pieces, the pieces the store
        still holds, back to back (a receiver repairs the tensors of a missing one)."""
        try:
            return self._read(self._delta_path(v))
        except MissingPiece:
            m = self.manifest(v)
            if not m.pieces:
                raise
        held = []
        for path in self._paths("deltas", v, m):
            try:
                held.append(self._read(path))
            except MissingPiece:
                pass  # the receiver repairs what it held
        if not held:
            raise MissingPiece(f"every piece of version {v} is missing from the store")
        return b"".join(held)

    def snapshot(self, v: int) -> StateDict:
        m = self.manifest(v)
        files = [from_bytes(self._read(p)) for p in self._paths("snapshots", v, m)]
        return pieces.snapshot(files, {k: s for k, (_, s, _) in m.tensors.items()}) if m.pieces else files[0]

    def tensor(self, name: str, v: int) -> Tensor:
        """One tensor at version v at full precision, rebuilt from the snapshot and that
        tensor's entries in deltas snapshot+1..v only; verified against manifest v."""
        return self.tensors([name], v)[name]

    def tensors(self, names: list[str], v: int) -> StateDict:
        """Like `tensor` for several names. A tensor coded in a group of small ones needs its
        group-mates at the version before, so those are rebuilt alongside (small by design)."""
        snap = self.head()["snapshot"]
        if v < snap:
            raise MissingPiece(f"version {v} was garbage-collected (oldest kept: {snap})")
        heads = {w: self._delta_headers(names[0], w) for w in range(snap + 1, v + 1)}
        need, grown = set(names), True
        while grown:  # close `need` under group membership at every version (a group may hold pieces)
            grown = False
            for _, files in heads.values():
                for _, h, _ in files:
                    for unit in h.units():
                        members = {pieces.parse(e.name)[0] for e in unit}
                        if len(members) > 1 and members & need and not members <= need:
                            need |= members
                            grown = True
        m = self.manifest(snap)
        files = [(p, *self._safetensors_header(p)) for p in self._paths("snapshots", snap, m)]
        state = {n: self._snapshot_tensor(n, files, m) for n in need}
        for w in range(snap + 1, v + 1):
            state = self._apply_delta(names[0], w, *heads[w], state)
        want = self.manifest(v).tensors
        out = {}
        for name in names:
            t = state.get(name)
            if name not in want or t is None or t.crc32() != want[name][2]:
                raise MissingPiece(f"tensor {name!r} cannot be rebuilt at version {v}")
            out[name] = t
        return out

    def _safetensors_header(self, path: str) -> tuple[int, dict]:
        """A safetensors file's header alone, and where its data starts."""
        (n,) = struct.unpack("<Q", self._read(path, 0, 8))
        return 8 + n, json.loads(self._read(path, 8, 8 + n))

    def _snapshot_tensor(self, name: str, files: list[tuple[str, int, dict]], m: Manifest) -> Tensor | None:
        """One tensor of a snapshot (`files`: its file, or its pieces, with their headers; `m`: its
        manifest), reading only its bytes."""
        parts = []
        for path, start, header in files:
            for key in [name] if not m.pieces else [k for k in header if pieces.parse(k)[0] == name]:
                if (h := header.get(key)) is not None:
                    b, e = h["data_offsets"]
                    data = np.frombuffer(self._read(path, start + b, start + e), dtype=bits_dtype(h["dtype"]))
                    parts.append((pieces.parse(key)[1], Tensor(h["dtype"], tuple(h["shape"]), data)))
        if not m.pieces or not parts:
            return parts[0][1] if parts else None
        dtype, shape, _ = m.tensors[name]
        return Tensor(dtype, shape, np.concatenate([t.data for _, t in sorted(parts, key=lambda p: p[0])]))

    def _delta_headers(self, name: str, w: int) -> tuple[Manifest, list[tuple[str, codec.Header, int]]]:
        """Version w's manifest, and the headers alone of its delta file or pieces with where their
        payloads start (`name`: for the error)."""
        try:
            m, out = self.manifest(w), []
            for path in self._paths("deltas", w, m):
                prefix = self._read(path, 0, codec.PREFIX_SIZE)
                end = codec.header_end(prefix)
                h = codec.read_header(prefix + self._read(path, codec.PREFIX_SIZE, end), with_payloads=False)
                out.append((path, h, end))
            return m, out
        except (MissingPiece, codec.DeltaError, struct.error) as err:
            raise MissingPiece(f"tensor {name!r} cannot be rebuilt past version {w - 1}: {err}") from None

    def _apply_delta(
        self, name: str, w: int, m: Manifest, files: list[tuple[str, codec.Header, int]], state: StateDict
    ) -> StateDict:
        """`state` (a set of whole tensors, None where absent) after version w (`m` and its delta
        file or pieces), reading only the payloads of those tensors (`name`: for the error)."""
        new = {}  # what the entries deliver: whole tensors, or pieces of them
        for path, h, end in files:
            base = pieces.cut({k: t for k, t in state.items() if t is not None}, [e.name for e in h.entries])
            for unit in h.units():
                e = unit[0]
                if not any(pieces.parse(u.name)[0] in state for u in unit):
                    continue
                if e.method == "same":
                    new[e.name] = base.get(e.name)
                    continue
                payload = memoryview(self._read(path, end + e.offset, end + e.offset + e.length))
                try:
                    if e.part is None:
                        new[e.name] = codec.decode_tensor(e, base.get(e.name), payload, check_base=False)  # crc checked
                        continue
                    good, bad = codec.decode_group(unit, base, payload, check_base=False)
                except codec.DeltaError as err:
                    raise MissingPiece(f"tensor {name!r} cannot be rebuilt at version {w}: {err}") from None
                if bad:
                    raise MissingPiece(f"tensor {name!r} cannot be rebuilt at version {w}: {bad} fail their checksums")
                new.update(good)
        if not m.pieces:
            return {n: new.get(n) for n in state}
        parts: dict[str, list] = {}
        for key, t in new.items():
            if t is not None:
                parts.setdefault(pieces.parse(key)[0], []).append((pieces.parse(key)[1], t))
        out = {}
        for n in state:  # a tensor whose pieces did not all come is None: it fails its checksum below
            ps = sorted(parts.get(n, []), key=lambda p: p[0])
            dtype, shape, _ = m.tensors.get(n, ("", (), 0))
            data = np.concatenate([t.data for _, t in ps]) if ps else None
            ok = data is not None and len(data) == int(np.prod(shape, dtype=np.int64))
            out[n] = Tensor(dtype, shape, data) if ok else None
        return out

    # -- writing

    def put_snapshot(self, state: StateDict, crcs: dict[str, int], version: int) -> int:
        """Write version's snapshot; returns its size."""
        blob = to_bytes(state)
        self._write(self._snapshot_path(version), blob)
        self._write(self._manifest_path(version), manifest_of(state, crcs, version, None, len(blob)).to_json())
        return len(blob)

    def put_delta(self, blob: bytes, manifest: Manifest) -> None:
        self._write(self._delta_path(manifest.version), blob)
        self._write(self._manifest_path(manifest.version), manifest.to_json())

    def put_piece(self, blob: bytes, version: int, piece: int, *, snapshot: bool) -> None:
        """Write one piece of a version (a rank's delta file, or its part of the snapshot); the
        version exists for readers once `seal` writes its manifest."""
        self._write((self._snapshot_path if snapshot else self._delta_path)(version, piece), blob)

    def seal(self, version: int, base_version: int | None, parts: list[tuple[int, dict]]) -> Manifest:
        """Write the manifest of a version every piece of which is written, and make it the latest.
        `parts`, one per piece in order: (its file's size, piece key -> (dtype, whole shape, crc,
        bytes)). The whole tensors' crcs are combined from their pieces'."""
        info = {k: v for _, keys in parts for k, v in keys.items()}
        shapes = {pieces.parse(k)[0]: (d, tuple(s)) for k, (d, s, _, _) in info.items()}
        crcs = pieces.whole_crcs(
            {k: (c, n) for k, (_, _, c, n) in info.items()},
            {name: int(np.prod(s, dtype=np.int64)) for name, (_, s) in shapes.items()},
        )
        m = Manifest(
            version,
            base_version,
            sum(n for n, _ in parts),
            {name: (*shapes[name], crcs[name]) for name in sorted(crcs)},
            len(parts),
        )
        self._write(self._manifest_path(version), m.to_json())
        self.set_head(version, version if base_version is None else self.head()["snapshot"])
        return m

    def clear(self) -> None:
        """Remove every piece of a previous chain (only the store's own files under the root)."""
        for part in ("HEAD.json", "snapshots", "deltas", "manifests"):
            if self.fs.exists(self._path(part)):
                self.fs.rm(self._path(part), recursive=True)

    def put_files(self, files: dict[str, bytes]) -> None:
        """Keep small files beside the weights (names without '/'); the index is written last, so a
        reader sees the whole set or none. A new chain (`clear`) leaves them."""
        for name, data in files.items():
            assert "/" not in name and name != FILE_INDEX, f"not a plain file name: {name!r}"
            self._write(self._path("files", name), data)
        self._write(self._path("files", FILE_INDEX), json.dumps(sorted(files)).encode())

    def files(self) -> dict[str, bytes]:
        """The files `put_files` kept, by name; MissingPiece when there are none."""
        names = json.loads(self._read(self._path("files", FILE_INDEX)))
        return {name: self._read(self._path("files", name)) for name in names}

    def set_head(self, latest: int, snapshot: int) -> None:
        self._write(self._path("HEAD.json"), json.dumps({"latest": latest, "snapshot": snapshot}).encode())

    def state(self, v: int) -> StateDict:
        """Every tensor at version v (the snapshot and the chain up to v)."""
        return self.tensors(sorted(self.manifest(v).tensors), v)

    def save_versions(self, versions: list[int], out_dir: str | Path) -> list[Path]:
        """Each of `versions` whole as `<version>.safetensors` under `out_dir` (bf16, as engines hold
        them): real consecutive weights for `strop sync encode` and `strop bench sync --demo-run`."""
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        paths = [Path(out_dir) / f"{v:08d}.safetensors" for v in versions]
        for v, path in zip(versions, paths):
            save(self.state(v), str(path))
        return paths

    def gc(self, keep_from: int, state: StateDict | None = None) -> None:
        """Make `keep_from` the oldest version: fold deltas up to it into a snapshot (in the
        store, not shipped anywhere) and delete everything older. `state`: version
        `keep_from`'s tensors when the caller holds them (nothing is decoded then)."""
        head = self.head()
        old = head["snapshot"]
        if keep_from <= old:
            return
        if keep_from > head["latest"]:
            raise ValueError(f"cannot keep from {keep_from}: latest is {head['latest']}")
        if state is None:
            state = self.snapshot(old)
            for w in range(old + 1, keep_from + 1):
                m, blob = self.manifest(w), self.delta_bytes(w)
                state = (
                    pieces.decode(state, blob, m.crcs()) if m.pieces else codec.decode(state, blob, check_base=False)
                )
        self.put_snapshot(state, self.manifest(keep_from).crcs(), keep_from)
        self.set_head(head["latest"], keep_from)
        self._drop_before(old, keep_from)

    def cut(self, v: int, nbytes: int) -> None:
        """Make version v the snapshot once each of its pieces' snapshot files is written (`put_piece`,
        `nbytes` in all): a sharded trainer's chain that `gc` cannot fold is cut at its ranks' own
        copies of the latest version."""
        head, m = self.head(), self.manifest(v)
        self._write(self._manifest_path(v), Manifest(v, None, nbytes, m.tensors, m.pieces).to_json())
        self.set_head(head["latest"], v)
        self._drop_before(head["snapshot"], v)

    def _drop_before(self, old: int, v: int) -> None:
        """Delete what the snapshot at v replaces: the snapshot at `old`, and the manifests and
        deltas (or their pieces) from it up to v."""
        for w in range(old, v):
            if self.fs.exists(self._manifest_path(w)):
                self.fs.rm(self._manifest_path(w))
            for path in self.fs.glob(self._path("deltas", f"{w + 1:08d}.*")):  # the delta or its pieces
                self.fs.rm(path)  # (a lost one is simply already gone)
        for path in self.fs.glob(self._path("snapshots", f"{old:08d}.*")):
            self.fs.rm(path)


@dataclass
class Publisher:
    """The trainer's side: `publish(state, version)` writes each new bf16 state as a delta against the
    previous one (`full=True`: every tensor whole, in the same file format, so receivers take the
    same path). The first version published, or the first after `restart`, is the snapshot.

    `piece`: this publisher writes piece `piece` of each version (a rank of a sharded trainer, whose
    `state` is its pieces, `strop.sync.pieces`): the file alone; the version appears when `Store.seal`
    writes its manifest, once every piece is written (so it neither clears the store nor moves HEAD)."""

    store: Store
    full: bool = False
    piece: int | None = None
    state: StateDict | None = None
    crcs: dict[str, int] = field(default_factory=dict)
    version: int = -1
    nbytes: int = 0  # size of the last file written (the snapshot, or a delta)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # `latest()` pairs state with version

    def restart(self) -> None:
        """Start a new chain: the next version published becomes the store's snapshot (after a
        resume, the trainer's restored weights)."""
        with self.lock:
            self.state, self.crcs, self.version = None, {}, -1

    def latest(self) -> tuple[int, StateDict]:
        """The last version published and its tensors (the trainer's own copy)."""
        with self.lock:
            return self.version, self.state or {}

    def publish(self, state: StateDict, version: int | None = None) -> int:
        """Write `state` as `version` (default: the next one); returns the version."""
        version = self.version + 1 if version is None else version
        assert version > self.version, f"version {version} published after {self.version}"
        crcs = {k: t.crc32() for k, t in state.items()}
        if self.state is None and self.piece is not None:
            blob = to_bytes(state)
            self.store.put_piece(blob, version, self.piece, snapshot=True)
            self.nbytes = len(blob)
        elif self.state is None:
            self.store.clear()
            self.nbytes = self.store.put_snapshot(state, crcs, version)
            self.store.set_head(version, version)
        else:
            assert version == self.version + 1, f"a delta takes {self.version} to {self.version + 1}, not {version}"
            blob = codec.encode(
                {} if self.full else self.state,
                state,
                version=version,
                base_version=self.version,
                base_crcs=self.crcs,
                new_crcs=crcs,
            )
            if self.piece is None:
                self.store.put_delta(blob, manifest_of(state, crcs, version, self.version, len(blob)))
                self.store.set_head(version, self.store.head()["snapshot"])
            else:
                self.store.put_piece(blob, version, self.piece, snapshot=False)
            self.nbytes = len(blob)
        kept = {k: Tensor(t.dtype, t.shape, t.data.copy()) for k, t in state.items()}
        with self.lock:
            self.state, self.crcs, self.version = kept, crcs, version
        return version

    def gc(self, keep: int) -> bool:
        """Keep at most 2 * `keep` deltas behind the latest version (0: all), folding the oldest
        into the snapshot `keep` at a time. A chain the store can no longer fold (one of its own
        deltas damaged or lost) is cut at the latest version, from the trainer's own copy:
        receivers behind it then fetch only the tensors that differ. A piece's publisher holds one
        piece of that copy: it returns False instead, and the sharded trainer cuts the chain from
        every rank's (`Store.cut`)."""
        if keep == 0 or self.version - self.store.head()["snapshot"] < 2 * keep:
            return True
        try:
            self.store.gc(self.version - keep)
        except (MissingPiece, codec.DeltaError):
            if self.piece is not None:
                return False
            self.store.gc(self.version, state=self.state)
        return True
