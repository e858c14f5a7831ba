"""The online cycle: served completions + users' ratings -> an update -> gates -> promote or refuse.

    ratings since the last cycle, of the served version v (or up to `max_staleness` older)
        -> rewards (`strop.online.rewards`, Tab-style by default)
        -> one importance-corrected policy-gradient step from the logged behaviour logprobs:
           strop's RL trainer and loss (`strop.rl.trainer`, `strop.rl.loss`: PPO clip + TIS, router
           replay for MoE); the rewards are the advantages, with no baseline (`strop.rl.advantages`:
           the reward map's asymmetry keeps rejected replies from being pushed down as hard as
           accepted ones are pulled up)
        -> candidate version c = the weight store's latest + 1, published as a delta (`strop.sync`)
        -> gates (`strop.online.gates`): candidate vs v, no regression beyond the interval
        -> promoted: every serving engine loads c from the store (`POST /weights/update`, admin key);
           refused: nothing served changes, the report says which gate failed
        -> a `deployments` row in the feedback store records the decision, its report, and how far
           the ratings were consumed

The store is the record: the served version is the last row that is not a refusal, and `rollback`
(`POST /weights/rollback` on every engine) is a row too, after which cycles train from the version
rolled back to. The weight store keeps every version (no GC), so any version can be rolled back to,
bit for bit. The trainer's fp32 master weights and optimizer state of each promoted version are kept
under the run directory (`trainer/v{V}/`, `RLTrainer.save`); a version without them starts from its bf16 weights.
"""

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx
import torch

from strop.config import RLSection
from strop.env.episode import Segment
from strop.env.harness.tools import load_tools
from strop.online.gates import GateSettings, compare, measure
from strop.online.monitors import classify, monitor_rates, offered_roles
from strop.online.rewards import RewardMap
from strop.online.store import DeploymentRow, RatedCompletion, Store
from strop.online.versions import Versions
from strop.outputs import atomic_dir
from strop.policy_api import generated_routing
from strop.rl.advantages import make_samples
from strop.rl.trajectory import Trajectory, TrajectoryGroup
from strop.sync.apply import bits_view
from strop.sync.store import Publisher
from strop.sync.store import Store as WeightStore


@dataclass
class CycleSettings:
    checkpoint: str  # the base policy directory: architecture and tokenizer
    weights: str  # the run's weight store (URL or directory)
    engines: list[str]  # `strop serve --keys --weights-store` URLs
    admin_key: str
    run_dir: Path
    rewards: RewardMap = field(default_factory=RewardMap)
    max_staleness: int = 1  # ratings of versions this far behind the served one are still used
    min_rated: int = 16  # fewer new ratings than this: the cycle waits for more
    rl: RLSection = field(default_factory=lambda: RLSection(lr=3e-4, micro_batch=16, measure_every=0))
    baseline: bool = False  # False: the mapped rewards are the advantages (`strop.rl.advantages`)
    frozen_layers: float = 0.0  # trainer.frozen_layers: the lower layers the update leaves as they are
    gates: GateSettings = field(default_factory=GateSettings)


def served(store: Store) -> DeploymentRow:
    rows = [d for d in store.deployments() if d.kind != "refused"]
    assert rows, "no deployment recorded: call `initialize` first"
    return rows[-1]


def _call(s: CycleSettings, url: str, path: str, body: dict | None = None, timeout: float = 600) -> dict:
    """One admin request to an engine (a POST of `body`, a GET without one): its JSON object, or
    ValueError in one line when the engine is unreachable, refuses or answers something else."""
    try:
        r = httpx.request(
            "GET" if body is None else "POST",
            url.rstrip("/") + path,
            json=body,
            headers={"Authorization": f"Bearer {s.admin_key}"},
            timeout=timeout,
        )
    except httpx.HTTPError as e:  # refused, timed out, no such host
        raise ValueError(f"engine {url} is unreachable: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise ValueError(f"{url}{path} answered {r.status_code}: {r.text[:300]}")
    try:
        answer = r.json()
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise ValueError(f"{url}{path} answered no JSON object (is it a `strop serve --keys` engine?): {r.text[:100]}")
    return answer


def _post(s: CycleSettings, path: str, body: dict) -> list[dict]:
    return [_call(s, url, path, body) for url in s.engines]


def _record(store: Store, kind: str, version: int, candidate: int | None, through: float, report: dict) -> None:
    seq = len(store.deployments())
    store.add_deployment(DeploymentRow(seq, time.time(), kind, version, candidate, through, report)).result()


def initialize(s: CycleSettings, store: Store) -> int:
    """Record the engines' served version as the initial deployment (once); returns the served version."""
    if store.deployments():
        return served(store).version
    versions = set()
    for url in s.engines:
        answer = _call(s, url, "/weights/version", timeout=30)
        if not isinstance(answer.get("version"), int):
            raise ValueError(f"{url}/weights/version answered no version: {json.dumps(answer)[:100]}")
        versions.add(answer["version"])
    if len(versions) != 1:
        raise ValueError(f"the engines serve different versions {sorted(versions)}; bring them to one first")
    version = versions.pop()
    _record(store, "initial", version, None, 0.0, {})
    return version


def version_dir(s: CycleSettings, version: int) -> Path:
    """A model directory of `version` (for the gates' engines and evaluation), made from the store once."""
    from strop.data.tokenizer import load_tokenizer
    from strop.model.policy import load_model, save_model

    path = s.run_dir / "versions" / f"v{version}"
    if not path.is_dir():
        model = load_model(s.checkpoint)
        model.load_state_dict({k: t.float() for k, t in Versions(s.weights).tensors(version).items()})
        save_model(model, load_tokenizer(s.checkpoint), path)
    return path


def segment(rc: RatedCompletion) -> Segment:
    c = rc.completion
    seg = Segment(temperature=float(c.request.get("temperature", 1.0)))
    seg.add_forced(c.prompt_ids)
    seg.add_generated(
        c.token_ids, c.logprobs, c.versions, generated_routing(c.routing, len(c.prompt_ids), len(c.token_ids))
    )
    return seg


def trainer_for(s: CycleSettings, version: int):
    """The RL trainer at `version`: its kept fp32 state, or the store's bf16 weights widened."""
    from strop.data.tokenizer import load_tokenizer
    from strop.model.policy import is_moe, load_model
    from strop.rl.orchestrator import router_replay
    from strop.rl.trainer import RLTrainer, no_replay
    from strop.train.device import freeze_lower

    model = load_model(s.checkpoint)
    kept = s.run_dir / "trainer" / f"v{version}"  # `RLTrainer.save`'s directory
    if not kept.is_dir():
        model.load_state_dict({k: t.float() for k, t in Versions(s.weights).tensors(version).items()})
    freeze_lower(model, s.frozen_layers)  # before the optimizer is made: no state for what is frozen
    pad_id = load_tokenizer(s.checkpoint).pad_token_id
    trainer = RLTrainer(
        model, s.rl, pad_id=pad_id, replay_ctx=router_replay if is_moe(model) else no_replay, version=version
    )
    if kept.is_dir():
        trainer.load(kept)
        for group in trainer.optimizer.param_groups:  # the kept optimizer state carries the lr it ran with
            group["lr"] = s.rl.lr
    return trainer


def publish(s: CycleSettings, state: dict[str, torch.Tensor]) -> int:
    """Publish `state` (bf16) as the store's next version, a delta on its latest; returns the version."""
    store = WeightStore(s.weights)
    latest = store.head()["latest"]
    base = store.state(latest)
    publisher = Publisher(store, state=base, crcs=store.manifest(latest).crcs(), version=latest)
    return publisher.publish({k: bits_view(v.detach().contiguous()) for k, v in state.items()}, latest + 1)


def traffic_monitors(store: Store, version: int, after: float, through: float) -> dict:
    """The monitors on what `version` served in (`after`, `through`]."""
    declared = load_tools().roles()  # the served product's tools: the built-in coding tools
    replies = [
        classify(c.text, offered_roles(c.request.get("tools"), declared))
        for c in store.completions_of(version, after, through)
    ]
    return monitor_rates(replies)


def known_figures(store: Store, version: int) -> dict | None:
    """Gate figures of a version from the last deployment report that measured it, if any."""
    for d in reversed(store.deployments()):
        if d.version == version and "served_figures" in d.report:
            return d.report["served_figures"]
    return None


def figures_of(s: CycleSettings, store: Store, version: int) -> dict:
    """Gate figures of a served version: as recorded when it was measured, else measured now."""
    return known_figures(store, version) or measure(str(version_dir(s, version)), s.gates)


def run_cycle(
    s: CycleSettings,
    store: Store,
    reward_of: Callable[[RatedCompletion], float] | None = None,
    log: Callable[[str], None] = lambda line: None,
) -> dict:
    """One cycle (see the module docstring); returns its report. `reward_of` replaces the reward
    map (the simulation's deliberately harmful update uses it)."""
    reward_of = reward_of or (lambda rc: s.rewards(rc.kind, rc.value))
    t0 = time.perf_counter()
    now = served(store)
    after, through = store.deployments()[-1].through, time.time()
    rated = [
        rc
        for rc in store.rated(after, through, now.version - s.max_staleness, now.version)
        if float(rc.completion.request.get("temperature", 1.0)) > 0
    ]  # greedy replies sampled no distribution
    report = {
        "served": now.version,
        "rated": len(rated),
        "traffic_monitors": traffic_monitors(store, now.version, after, through),
    }
    if len(rated) < s.min_rated:
        return {**report, "status": "waiting", "why": f"{len(rated)} new ratings, fewer than {s.min_rated}"}
    rewards = [reward_of(rc) for rc in rated]
    trajs = [
        Trajectory(rc.completion.id, "online", i, [segment(rc)], r) for i, (rc, r) in enumerate(zip(rated, rewards))
    ]
    samples = make_samples(
        [TrajectoryGroup("online", "online", len(trajs), trajs)],
        dr_grpo=s.rl.dr_grpo,
        norm_tokens=s.rl.dr_grpo_norm_tokens,
        baseline=s.baseline,
    )
    trainer = trainer_for(s, now.version)
    step = trainer.step(samples)
    candidate = publish(s, trainer.bf16_state_dict())
    log(
        f"[online] trained v{candidate} from v{now.version} on {len(rated)} ratings "
        f"(reward {sum(rewards) / len(rewards):+.3f}); gating"
    )
    current = figures_of(s, store, now.version)
    cand = measure(str(version_dir(s, candidate)), s.gates)
    gates = compare(current, cand)
    failed = sorted(name for name, g in gates.items() if not g["passed"])
    report.update(
        candidate=candidate,
        reward_mean=round(sum(rewards) / len(rewards), 4),
        train={k: step[k] for k in ("loss", "grad_norm", "clip_frac", "trunc_frac", "ratio_mean", "step_s")},
        gates=gates,
        failed_gates=failed,
        candidate_figures=cand,
        current_figures=current,
    )
    if failed:
        report.update(status="refused", served_figures=current)
        _record(store, "refused", now.version, candidate, through, report)
        log(f"[online] v{candidate} refused: {', '.join(failed)} regressed")
    else:
        trainer.version = candidate
        (s.run_dir / "trainer").mkdir(parents=True, exist_ok=True)
        with atomic_dir(s.run_dir / "trainer" / f"v{candidate}") as tmp:
            trainer.save(tmp)
        report.update(
            status="promoted", served_figures=cand, engines=_post(s, "/weights/update", {"version": candidate})
        )
        _record(store, "promoted", candidate, candidate, through, report)
        log(f"[online] v{candidate} promoted to {len(s.engines)} engine(s)")
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    return report


def rollback(s: CycleSettings, store: Store, to: int) -> dict:
    """Every engine back to version `to` of the store, recorded; later cycles train from it."""
    now = served(store)
    if to >= now.version:
        raise ValueError(f"a rollback goes to an older version than the served v{now.version}, not v{to}")
    engines = _post(s, "/weights/rollback", {"to": to})
    report = {"from": now.version, "to": to, "engines": engines}
    figures = known_figures(store, to)  # else the next cycle measures them
    if figures is not None:
        report["served_figures"] = figures
    _record(store, "rollback", to, None, store.deployments()[-1].through, report)
    return report
