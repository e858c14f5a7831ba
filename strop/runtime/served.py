"""An engine behind HTTP, kept current by the weight transport: the counterpart of `SyncedEngine`
for an engine this process cannot patch in place (a vLLM server the run started, or a running
server at a URL).

The receiver holds the trainer's bf16 snapshot on the host (an `EngineSync` over host tensors,
rounded from the policy directory at start). Each version arrives as a delta through the cluster's
relay, is verified against the trainer's checksums and applied to that host copy, so the copy *is*
the trainer's bf16 snapshot of the version. A vLLM server loads it from a checkpoint directory
written for it (safetensors, per-expert names as on disk; `strop.engine.vllm_server.VllmWeights`);
a `strop serve` reads the version from the run's store itself, so nothing is written for it
(`strop.runtime.engines.StoreVersionLoader`). The bootstrap loads
the whole snapshot once, so the server serves exactly the published bf16 values from the start.

Updates land between requests: a swap waits for the requests in flight to finish and holds new
ones back while the server loads (`ServingGate`), so every token of a request was sampled by one
version, the one `policy()` tags it with.
"""

import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Protocol

import torch

from strop.engine.server_process import ServerProcess
from strop.model.checkpoint_names import split_experts
from strop.policy_api import Generation, PolicyClient, SamplingParams
from strop.sync.apply import EngineSync, Staged, apply_inplace
from strop.sync.relay import RelayLink
from strop.sync.store import Store


class WeightLoader(Protocol):
    reads_files: bool  # whether the server loads the snapshot from the directory written for it

    def update_weights(self, path: str | None, version: int) -> dict: ...


class ServingGate:
    """Requests share the server; a weight swap has it alone (waiting for the requests in flight,
    holding new ones back). `busy_s`: seconds with at least one request in flight."""

    def __init__(self):
        self.cond = threading.Condition()
        self.requests = 0
        self.swapping = False
        self.swaps_waiting = 0
        self.busy_s = 0.0
        self._busy_since = 0.0

    def request(self):
        gate = self

        class _Request:
            def __enter__(self):
                with gate.cond:
                    gate.cond.wait_for(lambda: not gate.swapping and not gate.swaps_waiting)
                    if gate.requests == 0:
                        gate._busy_since = time.perf_counter()
                    gate.requests += 1

            def __exit__(self, *exc):
                with gate.cond:
                    gate.requests -= 1
                    if gate.requests == 0:
                        gate.busy_s += time.perf_counter() - gate._busy_since
                    gate.cond.notify_all()

        return _Request()

    def swap(self):
        gate = self

        class _Swap:
            def __enter__(self):
                with gate.cond:
                    gate.swaps_waiting += 1
                    gate.cond.wait_for(lambda: gate.requests == 0 and not gate.swapping)
                    gate.swaps_waiting -= 1
                    gate.swapping = True

            def __exit__(self, *exc):
                with gate.cond:
                    gate.swapping = False
                    gate.cond.notify_all()

        return _Swap()


class ServedEngine:
    """`client`: the server's `PolicyClient` (token ids in); `loader`: its weight updates.
    `initial`: the policy's tensors by the trainer's names (rounded to bf16 here), which the server
    serves now: `version` when they are a published version the server started from (an engine
    bootstrapped from the store), else -1. `owned`: the server process this engine started,
    stopped by `close`."""

    def __init__(
        self,
        client: PolicyClient,
        loader: WeightLoader,
        initial: dict[str, torch.Tensor],
        store_url: str,
        relay: RelayLink,
        origin_url: str,
        owned: ServerProcess | None = None,
        version: int = -1,
    ):
        self.client, self.loader, self.owned = client, loader, owned
        self.gate = ServingGate()
        self._dir = Path(tempfile.mkdtemp(prefix="strop-served-weights-"))
        store = Store(store_url)
        names = sorted(store.manifest(store.head()["snapshot"]).tensors)
        missing = [n for n in names if n not in initial]
        if missing:
            raise ValueError(f"the served model has no tensors {missing[:3]}: it is not the trainer's policy")
        live = {n: initial[n].detach().to(torch.bfloat16).clone() for n in names}
        self.version = version  # -1: the server's own weights, not yet the published bf16 snapshot
        self.sync = EngineSync(live, version=version, swap=self._swap)
        self.stop = threading.Event()
        self.thread = threading.Thread(
            target=self.sync.follow, args=(store, relay, origin_url, self.stop), name="strop-served-sync", daemon=True
        )
        self.thread.start()

    def _write(self, version: int) -> Path:
        """The host snapshot as a checkpoint directory for a server that loads files."""
        from safetensors.torch import save_file

        path = self._dir / f"v{version}"
        path.mkdir()
        tensors = split_experts(self.sync.live)
        save_file({k: t.contiguous().clone() for k, t in tensors.items()}, str(path / "model.safetensors"))
        return path

    def _swap(self, staged: Staged) -> float:
        """Patch the host snapshot and have the server load the version between requests; returns
        how long requests were held back."""
        apply_inplace(self.sync.live, staged)
        path = self._write(staged.version) if self.loader.reads_files else None
        t0 = time.perf_counter()
        with self.gate.swap():
            self.loader.update_weights(str(path) if path else None, staged.version)
            self.version = staged.version
        pause = time.perf_counter() - t0
        for old in self._dir.iterdir():  # the server has read it; only the latest is kept
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
        return pause

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        with self.gate.request():
            version = self.version
            gen = self.client.generate(prompt_ids, params)
        gen.versions = [version] * len(gen.token_ids)  # no swap can land during a request
        return gen

    def policy(self) -> PolicyClient:
        return self

    def stats(self) -> dict:
        return {"busy_s": self.gate.busy_s}

    def wait_version(self, version: int, timeout: float | None = None) -> bool:
        return self.sync.wait_version(version, timeout)

    def close(self) -> None:
        """Stop following the relay (the thread ends at its next poll), then the server this engine owns."""
        self.stop.set()
        with self.gate.swap():  # a swap under way finishes first
            if self.owned is not None:
                self.owned.close()
        shutil.rmtree(self._dir, ignore_errors=True)
