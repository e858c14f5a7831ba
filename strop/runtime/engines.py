"""A run's inference engines, by `rollout.engine`, behind one interface (`RunEngine`):

- `strop`: strop's engine in this process, patched in place by its sync thread (`SyncedEngine`);
- `vllm`: a vLLM server this engine starts as a child process on a port it picked, with the flags
  RL needs (`strop.engine.vllm_server`), kept current by a host-side receiver that loads each
  published bf16 snapshot into it between requests (`ServedEngine`), stopped at `close`;
- an http(s):// URL: a running `strop serve` started with `--keys` and `--weights-store` = this
  run's store; the run authenticates with the admin key in `$STROP_API_KEY` (scopes infer and
  admin) and has it load each version by number from the store (never a path); the run does not
  own it.

Every kind hands rollouts the same `PolicyClient` (token ids in; logprobs, versions and routed
experts out), follows the same relay, and reports its busy seconds. Each starts from the policy
directory on this machine, or, on a node without one (a Ray engine actor), from the weight store
(`strop.engine.bootstrap`).
"""

import os
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Protocol

from strop.config import Config
from strop.data.tokenizer import load_tokenizer
from strop.engine.bootstrap import checkpoint_from_store, latest_weights, policy_files, zero_policy
from strop.engine.engine import Engine
from strop.errors import UserError
from strop.policy_api import PolicyClient
from strop.runtime.cpus import pin
from strop.sync.apply import EngineSync
from strop.sync.relay import RelayLink

API_KEY_ENV = "STROP_API_KEY"  # the key a run presents to a served engine named by URL
VLLM_START_TIMEOUT_S = 900.0  # loading the model and a first warm-up on a busy CPU take minutes


def api_key_headers() -> dict[str, str]:
    """The Authorization header for the key in `$STROP_API_KEY`, or none when it is unset."""
    key = os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


class RunEngine(Protocol):
    sync: EngineSync  # what the engine serves, as the weight transport sees it

    def policy(self) -> PolicyClient: ...

    def stats(self) -> dict:
        """Figures since start: `busy_s` (seconds it was working), and for strop's engine its
        counters (`strop.engine.engine.Engine.stats`)."""
        ...

    def wait_version(self, version: int, timeout: float | None = None) -> bool: ...

    def close(self) -> None: ...


def summed_stats(stats: list[dict]) -> dict[str, float]:
    """Engines' counters (`RunEngine.stats`: seconds `*_s` and token counts `*_tokens`) added up."""
    total: Counter = Counter()
    for s in stats:
        total.update({k: v for k, v in s.items() if k.endswith(("_s", "_tokens"))})
    return dict(total)


def check_engine_available(engine: str) -> None:
    """UserError when `rollout.engine` names a backend this machine cannot start."""
    from strop.engine.vllm_server import installed

    if engine == "vllm" and not installed():
        raise UserError(
            "rollout.engine = 'vllm' needs vLLM, which is not installed here: run `make vllm` "
            "(the optional vLLM engine, see the README's 'vLLM' section)"
        )


def start_engine(
    cfg: Config,
    index: int,
    policy_dir: str | None,
    tokenizer,
    store_url: str,
    relay: RelayLink,
    origin_url: str,
    cpus: frozenset[int] | None = None,
    workdir: Path | None = None,
) -> RunEngine:
    """Engine `index` of the run, started and following `relay`. Its starting weights: the policy
    in `policy_dir` (on this machine: the inline runtime), or with `policy_dir` None the weight
    store's (`strop.engine.bootstrap`: an engine on a node that has no copy of the policy, whose
    files it writes into `workdir`; `tokenizer` None: the store's)."""
    r = cfg.rollout
    if policy_dir is None:
        assert workdir is not None, "an engine that starts from the store needs a directory of its own"
        from_store = policy_files(store_url, workdir / "policy")
        tokenizer = tokenizer or load_tokenizer(from_store)
    if r.engine == "strop":
        from strop.model.policy import load_model
        from strop.runtime.weights import SyncedEngine

        engine = TimedEngine(
            load_model(policy_dir) if policy_dir else zero_policy(from_store),
            tokenizer,
            max_batch=r.engine_batch,
            max_len=r.max_context,
            seed=cfg.run.seed + index,
            cpus=cpus,
        )
        synced = SyncedEngine(engine, store_url, relay, origin_url)
        engine.start()
        return synced
    check_engine_available(r.engine)
    from strop.engine.endpoint import EndpointClient
    from strop.model.policy import load_model
    from strop.runtime.served import ServedEngine

    if r.engine == "vllm":
        version = -1  # the served weights are not yet a published version: the first sync checks every tensor
        if policy_dir is not None:
            initial = load_model(policy_dir).state_dict()
        else:  # vLLM starts from a checkpoint directory: the store's latest version, written here
            version, initial = checkpoint_from_store(store_url, workdir / "checkpoint")
            policy_dir = str(workdir / "checkpoint")
        from strop.engine.server_process import ServerProcess
        from strop.engine.vllm_server import VllmWeights, returns_routed_experts, vllm_argv, vllm_env
        from strop.threads import set_threads

        routed = returns_routed_experts()
        if not routed:
            warnings.warn(
                "vLLM cannot return routed experts here (on CPU its V2 model runner needs Triton's CPU "
                "backend): the trainer recomputes MoE routing, without router replay",
                stacklevel=2,
            )
        server = ServerProcess(
            vllm_argv(
                policy_dir,
                name="strop",
                max_len=r.max_context,
                max_batch=r.engine_batch,
                seed=cfg.run.seed + index,
                routed_experts=routed,
                gpu_memory=r.vllm_gpu_memory,
            ),
            env=vllm_env(1 if cpus else set_threads(), routed),
            start_timeout_s=VLLM_START_TIMEOUT_S,
        )
        try:
            return ServedEngine(
                EndpointClient(server.url, model="strop"),
                VllmWeights(server.url),
                initial,
                store_url,
                relay,
                origin_url,
                owned=server,
                version=version,
            )
        except BaseException:
            server.close()
            raise
    client = EndpointClient(r.engine, headers=api_key_headers())
    try:
        client.connect()
    except ConnectionError as e:
        raise UserError(f"config key 'rollout.engine': {e}") from None
    # it holds weights of its own; the host copy starts from the policy's, or the store's, and the
    # first sync checks every tensor
    initial = load_model(policy_dir).state_dict() if policy_dir is not None else latest_weights(store_url)[1]
    return ServedEngine(client, StoreVersionLoader(client), initial, store_url, relay, origin_url)


class StoreVersionLoader:
    """A strop server's side of a weight update: it loads the version from the run's store (it was
    started with `--weights-store` = this run's store), so no path crosses the wire and the receiver
    writes no snapshot for it."""

    reads_files = False

    def __init__(self, client):
        self.client = client

    def update_weights(self, path: str | None, version: int) -> dict:
        return self.client.load_version(version)


class TimedEngine(Engine):
    """An `Engine` that counts the seconds its steps did work (its busy time) and pins its loop
    thread on the first step."""

    def __init__(self, *args, cpus: frozenset[int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.busy_s = 0.0
        self._cpus, self._pinned = cpus, False

    def step(self) -> bool:
        if not self._pinned:
            pin(self._cpus)
            self._pinned = True
        t0 = time.perf_counter()
        worked = super().step()
        if worked:
            self.busy_s += time.perf_counter() - t0
        return worked
