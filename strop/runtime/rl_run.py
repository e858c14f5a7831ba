"""Building a run: `train_rl` composes an RL run from a config (its tasks, its weight store, the
runtime that places trainer, engines and rollouts, the orchestrator's loop) and runs or resumes it.
It is the one way a run is built: `strop train`, the demo and `strop bench async` call it (the tests
and `strop bench scaleout`, which drive a runtime themselves, take `train_tasks` and a runtime's `start_*`).

Starts from `policy_dir` (default `<run_dir>/sft/model`), trains on the train split of
`rollout.suite`, and writes `<run_dir>/rl/`: `metrics.jsonl` (one row per step), `report.md` with
plots, `checkpoint/` (the whole run, every `rollout.ckpt_every` steps), `model/` (the final policy),
`weights/` (the versioned weight store the engines sync from, unless `sync.store` puts it elsewhere),
`snapshots/` (the last two versions), `placement.json` (on Ray: where each actor landed) and
`result.json`.
Rerunning the same call resumes from the checkpoint; a finished run only reports.
"""

import json
import os
import sys
from pathlib import Path
from typing import Literal

from strop.config import Config, to_dict
from strop.errors import UserError
from strop.outputs import (
    claiming,
    config_changes,
    describe_changes,
    record_config,
    recorded_config,
    remove_output,
    write_atomic,
)


def train_tasks(cfg: Config) -> list:
    """The tasks a run trains on: `rollout.train_tasks` of the train split of `rollout.suite` per
    difficulty, from index `rollout.train_start` on (`strop.env.tasks.suites.draw_tasks`)."""
    from strop.env.tasks.suites import draw_tasks, selection_note, with_default_image

    r = cfg.rollout
    tasks = draw_tasks(r.suite, "train", r.difficulties, r.train_tasks, r.train_start)
    note = selection_note(r.suite, "train", r.difficulties, "rollout.difficulties", len(tasks))
    if note and not tasks:
        raise UserError(note)
    if note:
        print(f"[rl] warning: {note}", file=sys.stderr, flush=True)
    if not tasks:
        raise UserError(
            f"rollout.train_start = {r.train_start} leaves no train tasks of suite {r.suite!r} "
            f"at rollout.difficulties = {r.difficulties}"
        )
    return with_default_image(tasks, r.image)


def _store_url(cfg: Config, out: Path) -> str:
    """Where the run's weights are published: `sync.store`, or the output directory's weights/."""
    return cfg.sync.store or str(out / "weights")


def _start_runtime(
    cfg: Config,
    runtime: str,
    policy_dir: str,
    tasks: dict,
    *,
    store: str,
    ray_address: str | None = None,
    cpus=None,
    trainer_process: bool = False,
):
    import fsspec
    import transformers
    from fsspec.implementations.local import LocalFileSystem

    from strop.model.policy import is_moe, load_model_config
    from strop.rl.orchestrator import router_replay
    from strop.rl.trainer import no_replay
    from strop.runtime.engines import check_engine_available

    check_engine_available(cfg.rollout.engine)  # before any model loads
    replay = router_replay if is_moe(load_model_config(policy_dir)) else no_replay
    transformers.logging.set_verbosity_error()
    if runtime == "inline":
        from strop.runtime.inline import start_inline
        from strop.train.device import device_type

        device_type(cfg.trainer)  # cuda where there is none: one line here, not an error in the trainer's process

        return start_inline(cfg, policy_dir, tasks, replay, cpus=cpus, trainer_process=trainer_process, store_url=store)
    from strop.runtime.ray.actors import start_ray

    if ray_address and isinstance(fsspec.core.url_to_fs(store)[0], LocalFileSystem):
        print(
            f"[rl] warning: the weight store {store!r} is a local directory: engines on other machines receive "
            f"deltas through their relays but cannot join or repair unless it is shared storage (set sync.store)",
            file=sys.stderr,
            flush=True,
        )
    return start_ray(cfg, policy_dir, tasks, replay, address=ray_address, cpus=cpus, store_url=store)


RERUN_IGNORED = ("run.name", "run.out_dir", "run.threads", "log")  # where and how a run is seen, not what it computes
RESUME_FIXED = ("mode", "policy", "model")  # what a checkpoint is of: no resuming it under another
RERUN_HINT = "--resume continues it under the new config, --force deletes it and starts again"


def train_rl(
    cfg: Config,
    *,
    mode: str = "async",
    runtime: str = "inline",
    policy_dir: str | Path | None = None,
    out_dir: str | Path | None = None,
    ray_address: str | None = None,
    cpus=None,
    trainer_process: bool = False,
    quiet: bool = False,
    on_change: Literal["refuse", "resume", "force"] = "refuse",
    hint: str = RERUN_HINT,
) -> dict:
    """Run (or resume) RL; returns the run's figures and writes `out_dir/model` at the end. `cpus` and
    `trainer_process` place the inline runtime (see `strop.runtime.inline`).

    The output directory records the run's config (mode, policy and config); a rerun whose record
    differs is refused with what changed and `hint` (`on_change="refuse"`), continues from the last
    checkpoint under the new config (`"resume"`, not for another model, mode or policy), or deletes
    the run and starts again (`"force"`). A refusal leaves nothing behind."""
    from strop.model.policy import is_model_dir, load_model, save_model
    from strop.rl.orchestrator import Orchestrator
    from strop.rl.report import write_report

    policy_dir = Path(policy_dir or cfg.run_dir / "sft" / "model")
    out = Path(out_dir or cfg.run_dir / "rl")
    if not is_model_dir(policy_dir):
        raise UserError(f"no policy at {str(policy_dir)!r}; run `strop sft` first or pass --policy DIR")
    tasks = {t.id: t for t in train_tasks(cfg)}
    record = {"mode": mode, "policy": os.path.realpath(policy_dir), **to_dict(cfg)}
    if on_change == "force":
        remove_output(out, "train")
    with claiming(out, "train"):  # it overwrites config.json, checkpoint/, model/ in there
        old = recorded_config(out)
        changes = config_changes(old, record, RERUN_IGNORED) if old is not None else {}
        if changes and on_change == "refuse":
            raise UserError(f"{str(out)!r} holds a run made with another config ({describe_changes(changes)}); {hint}")
        if changes:
            fixed = {k: v for k, v in changes.items() if k.split(".")[0] in RESUME_FIXED}
            if fixed:
                raise UserError(
                    f"{str(out)!r} cannot be resumed under another model, mode or policy "
                    f"({describe_changes(fixed)}); --force deletes it and starts again"
                )
            print(f"[rl] resuming {out} under a changed config: {describe_changes(changes)}", flush=True)
        elif (out / "result.json").is_file():
            return json.loads((out / "result.json").read_text())
        store = _store_url(cfg, out)
        rt = _start_runtime(
            cfg,
            runtime,
            str(policy_dir),
            tasks,
            store=store,
            ray_address=ray_address,
            cpus=cpus,
            trainer_process=trainer_process,
        )
    try:
        (out / "result.json").unlink(missing_ok=True)  # resumed under a changed config: a finished run goes on
        record_config(out, record)  # only now: a run refused above keeps the record it had
        orch = Orchestrator(
            cfg,
            rt,
            list(tasks),
            mode,
            out,
            log=(lambda row: None) if quiet else _print_row,
            difficulties={t.id: int(t.metadata.get("difficulty", 0)) for t in tasks.values()},
        )
        if orch.resume():
            print(f"[rl] resumed at step {orch.step} (version {rt.version})", flush=True)
        if runtime == "ray":  # where Ray placed the trainer's ranks, the relays and the engines
            write_atomic(out / "placement.json", json.dumps(rt.placement(), indent=2))
        result = orch.run()
        sync_s = sorted(rt.sync_seconds().values())  # per version: its publication to the last engine serving it
        _save_last_versions(store, out / "snapshots")
        model = load_model(policy_dir)
        model.load_state_dict(rt.state_dict()["model"])
        save_model(
            model, rt.tokenizer, out / "model", extra={"config": to_dict(cfg), "rl": {"mode": mode, "steps": orch.step}}
        )
    finally:
        rt.close()
    result = {"mode": mode, "runtime": runtime, **result}
    if sync_s:
        result["weight_sync_s"] = {"median": sync_s[len(sync_s) // 2], "max": sync_s[-1], "versions": len(sync_s)}
    write_atomic(out / "result.json", json.dumps(result, indent=2))  # marks the run finished: whole or absent
    write_report(out, out / "metrics.jsonl", {})
    return result


def _save_last_versions(store: str, out_dir: Path) -> list[Path]:
    """The last two published versions (`Store.save_versions`), for `strop bench sync --demo-run`."""
    from strop.sync.store import Store

    s = Store(store)
    head = s.head()
    return s.save_versions(list(range(max(head["latest"] - 1, head["snapshot"]), head["latest"] + 1)), out_dir)


def _print_row(row: dict) -> None:
    print(
        f"[rl] step {row['step']} v{row['version']} reward {row['reward']:.3f} solve {row['solve_rate']:.3f} "
        f"k3 {row['k3']:.4f} clip {row['clip_frac']:.3f} stale<= {row['staleness_max']} dropped {row['dropped_stale']} "
        f"hacked {row['hacked']} trainer {row['trainer_busy']:.2f} engine {row['engine_busy']:.2f} "
        f"{row['rollout_tokens_per_s']:.0f} tok/s; step {row['time_step_s']:.1f} s (waited {row['time_wait_s']:.1f}, "
        f"trained {row['time_train_s']:.1f}) {row['wall_s']:.0f} s",
        flush=True,
    )
    if row.get("objective_gain", 0.0) < 0:
        print(
            f"[rl] step {row['step']} lowered its own objective (objective_gain {row['objective_gain']:.2e}): "
            "the update overshot; a smaller rl.lr takes steps the reward asks for",
            flush=True,
        )
