"""The weight transport on the real path, in the inline runtime: the trainer (a child process)
encodes each version's delta itself, so only metrics cross its pipe and only deltas leave it over
the transport (bytes counted on both), every engine's weights equal the trainer's bf16 snapshot
bit for bit after each sync, and a delta damaged or lost in the store mid-run is repaired one
tensor at a time while the run goes on."""

import json

import torch

from strop.config import load_config

# The random policy earns no reward, so its gradients are zero; weight decay (applied once the step
# runs backward: skip_zero_advantage=false) still moves every weight by lr * wd relative per step,
# which changes a few % of its bf16 values: real, sparse deltas.
CONFIG = [
    "rl.group_size=2",
    "rl.batch_groups=1",
    "rl.steps=3",
    "rl.lr=1e-3",
    "rl.weight_decay=0.1",
    "rl.skip_zero_advantage=false",
    "rollout.engines=2",
    "rollout.workers=2",
    "rollout.engine_batch=4",
    "rollout.train_tasks=4",
    "rollout.max_turns=1",
    "rollout.max_turn_tokens=16",
    "rollout.max_context=1536",
    "rollout.ckpt_every=100",
]


def _run(tmp_path, policy_dir, *, trainer_process: bool, steps: int = 3):
    from strop.rl.orchestrator import Orchestrator, router_replay
    from strop.runtime.cpus import split_cores
    from strop.runtime.inline import start_inline
    from strop.runtime.rl_run import train_tasks

    cfg = load_config(None, CONFIG + [f"rl.steps={steps}"])
    tasks = {t.id: t for t in train_tasks(cfg)}
    rt = start_inline(
        cfg,
        str(policy_dir),
        tasks,
        router_replay,
        cpus=split_cores(),
        trainer_process=trainer_process,
        store_url=str(tmp_path / "weights"),
    )
    checked = []

    try:
        orch = Orchestrator(
            cfg, rt, list(tasks), "sync", tmp_path / "rl", log=lambda row: checked.append(_engines_equal_trainer(rt))
        )
        result = orch.run()
        stats = rt.trainer.sync_stats()
        reply_bytes = dict(getattr(rt.trainer, "reply_bytes", {}))
        repaired = [x for s in rt.engines for rep in s.sync.reports for x in rep.repaired]
        snapshot_bytes = sum(t.numel() * 2 for t in rt.trainer.bf16_state_dict().values())
    finally:
        rt.close()
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    return result, rows, checked, stats, reply_bytes, repaired, snapshot_bytes


def _engines_equal_trainer(rt) -> bool:
    """Every engine's live weights, bit for bit, against the trainer's last published bf16 snapshot."""
    trainer = rt.trainer.bf16_state_dict()
    return all(torch.equal(e.engine.named_tensors()[k], t.float()) for e in rt.engines for k, t in trainer.items())


def test_only_deltas_leave_the_trainer_process_and_engines_match_it_bit_for_bit(tmp_path, tiny_policy_dir):
    from strop.sync import codec
    from strop.sync.store import Store

    result, rows, checked, stats, reply_bytes, _, snapshot_bytes = _run(tmp_path, tiny_policy_dir, trainer_process=True)
    assert result["steps"] == 3 and checked == [True, True, True]
    store = Store(str(tmp_path / "weights"))
    deltas = [store.manifest(v).nbytes for v in (1, 2, 3)]
    # the transport: one relay (one cluster) pulled each delta once, and nothing else went out
    assert stats["sent_by_version"] == {v: [1, n] for v, n in zip((1, 2, 3), deltas)}
    assert stats["bytes_sent"] == sum(deltas) == rows[-1]["bytes_synced"]
    changed = [sum(e.method != "same" for e in codec.read_header(store.delta_bytes(v)).entries) for v in (1, 2, 3)]
    assert min(changed) > 0 and max(deltas) < snapshot_bytes / 4  # sparse deltas, not snapshots
    # the pipe: a step's reply is its metrics row, a few kB, never weights
    assert reply_bytes["step"] / 3 < 16_000 < snapshot_bytes


def test_a_delta_damaged_or_lost_in_the_store_is_repaired_per_tensor_and_the_run_goes_on(
    tmp_path, tiny_policy_dir, monkeypatch
):
    """The in-process trainer writes version 2's delta with one tensor's payload corrupted and loses
    version 3's file: engines repair just the tensors those deltas failed to deliver."""
    from strop.sync import codec
    from strop.sync.store import Store

    damaged: dict = {}
    put_delta = Store.put_delta

    def faulty_put_delta(store, blob, manifest):
        if manifest.version == 2:
            unit = max(codec.read_header(blob).units(), key=lambda u: u[0].length)  # a tensor, or a group of small ones
            blob = bytearray(blob)
            blob[codec.header_end(blob) + unit[0].offset + unit[0].length // 2] ^= 0x10
            damaged[2] = sorted(e.name for e in unit)
            blob = bytes(blob)
        put_delta(store, blob, manifest)
        if manifest.version == 3:
            store.fs.rm(store._delta_path(3))
            damaged[3] = sorted(
                n for n, (_, _, crc) in manifest.tensors.items() if crc != store.manifest(2).tensors[n][2]
            )

    monkeypatch.setattr(Store, "put_delta", faulty_put_delta)  # the trainer runs in this process
    result, _, checked, _, _, repaired, _ = _run(tmp_path, tiny_policy_dir, trainer_process=False, steps=4)
    assert result["steps"] == 4 and checked == [True] * 4
    # both engines fetched the tensors of the one damaged payload, nothing else
    assert sorted({r[3:] for r in repaired if r.startswith("v2:")}) == damaged[2]
    assert sorted({r[3:] for r in repaired if r.startswith("v3:")}) == damaged[3]  # only what changed in v3


def test_a_trainer_process_that_dies_is_an_error_not_a_hang(tmp_path):
    """The child's end of the pipe is closed in the parent, so a trainer process that dies (here at
    start: no policy where it looks) ends the wait with an error instead of blocking it forever."""
    import threading

    from strop.config import Config
    from strop.rl.orchestrator import router_replay
    from strop.runtime.trainers import TrainerProcess

    errors = []

    def start() -> None:
        try:
            TrainerProcess(Config(), str(tmp_path / "no-policy"), router_replay, 0, None, str(tmp_path / "weights"))
        except RuntimeError as e:
            errors.append(e)

    waiter = threading.Thread(target=start, daemon=True)  # a regression hangs this thread, not the session
    waiter.start()
    waiter.join(timeout=120)
    assert not waiter.is_alive(), "TrainerProcess still waits for a child that died"
    assert len(errors) == 1 and "trainer process exited" in str(errors[0])
