"""The sharded trainer (FSDP2 over gloo ranks, local processes) against the single-process trainer
on the tiny MoE: the same samples give the same losses and weights, what rank 0 publishes is the
gathered bf16 snapshot, and a checkpoint written by N ranks (each its shards) loads at another count."""

import pytest
import torch

from strop.config import Config, ParallelSection, RLSection, TrainerSection, load_config
from strop.errors import UserError
from strop.model.policy import load_model
from strop.rl.advantages import Sample
from strop.rl.orchestrator import router_replay
from strop.rl.trainer import RLTrainer
from strop.runtime.trainers import start_trainer
from strop.sync import codec, pieces
from strop.sync.replica import Replica
from strop.sync.store import Store
from strop.sync.tensors import Tensor
from strop.train.parallel import Ranks
from tests.test_rl_trainer import sample_groups


def step_batches(policy_dir, rows_per_step: list[int]) -> list[list]:
    """Samples drawn from the policy itself, routing recorded, `rows` segments per step, with
    advantages +-1 (the toy reward is rarely earned in 3 tokens)."""
    model = load_model(policy_dir)
    torch.manual_seed(0)
    return [
        [
            Sample(t, (-1.0) ** i, 1 / (3 * rows), t.reward)
            for g in sample_groups(model, step, rows // 4, 4, 3, step, routing=True)
            for i, t in enumerate(g.trajectories)
        ]
        for step, rows in enumerate(rows_per_step)
    ]


def compare(cfg: Config, policy_dir, pad_id: int, batches: list[list], tmp_path) -> list[tuple]:
    """Per step: (single row, sharded row, single weights, sharded weights)."""

    def reference():  # the warm start, when the loss anchors to it
        return load_model(policy_dir) if cfg.rl.ref_kl_coef > 0 else None

    single = RLTrainer(load_model(policy_dir), cfg.rl, pad_id=pad_id, replay_ctx=router_replay, reference=reference())
    expected = [(single.step(b), single.state_dict()["model"]) for b in batches]
    sharded = start_trainer(cfg, str(policy_dir), router_replay, pad_id, str(tmp_path / "weights"))
    try:
        sharded.publish()
        got = [(sharded.step(b), sharded.state_dict()["model"]) for b in batches]
        published = Store(str(tmp_path / "weights")).state(sharded.version)
        gathered = sharded.bf16_state_dict()
        sharded.save(tmp_path / "ckpt")  # each rank its shards
    finally:
        sharded.close()
    for name, t in gathered.items():  # the store's latest version is the gathered bf16 snapshot, bit for bit
        assert published[name].data.tobytes() == t.view(torch.uint16).numpy().tobytes(), name
    restored = RLTrainer(load_model(policy_dir), cfg.rl, pad_id=pad_id, reference=reference())  # one process
    restored.load(tmp_path / "ckpt")
    assert restored.version == len(batches)
    assert all(torch.equal(restored.state_dict()["model"][k], v) for k, v in got[-1][1].items())
    return [(a, b, sa, sb) for (a, sa), (b, sb) in zip(expected, got)]


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_ranks_anchor_to_the_reference_as_one_process(tiny_policy_dir, tiny_tokenizer, tmp_path):
    """With `rl.ref_kl_coef`, each rank loads its shards of the warm start as the reference: the
    KL to it and the weights after two steps are those of one process."""
    rl = RLSection(lr=1e-2, micro_batch=4, grad_clip=0.0, ref_kl_coef=0.5)
    cfg = Config(rl=rl, trainer=TrainerSection(ParallelSection(fsdp=2)))
    steps = compare(cfg, tiny_policy_dir, tiny_tokenizer.pad_token_id, step_batches(tiny_policy_dir, [8, 8]), tmp_path)
    assert steps[0][0]["ref_kl"] == 0.0 and steps[1][0]["ref_kl"] > 0
    for one, two, w1, w2 in steps:
        assert one["ref_kl"] == pytest.approx(two["ref_kl"], rel=1e-5, abs=1e-9)
        assert max_diff(w1, w2) < 1e-6


def test_two_ranks_train_as_one_process(tiny_policy_dir, tiny_tokenizer, tmp_path):
    """Two ranks, two micro-batches a step (one each), no clipping: the ranks' gradients add up as
    one process adds them, so the weights are bitwise the same. A step with three micro-batches
    (one rank pads with a weightless copy) may differ by float32 rounding (the additions are in
    another order): measured bitwise here too; the bound is 1e-6. (Clipping on many ranks:
    `test_four_ranks_and_a_resume_at_another_count`.)"""
    cfg = Config(rl=RLSection(lr=1e-2, micro_batch=4, grad_clip=0.0), trainer=TrainerSection(ParallelSection(fsdp=2)))
    steps = compare(
        cfg, tiny_policy_dir, tiny_tokenizer.pad_token_id, step_batches(tiny_policy_dir, [8, 8, 12]), tmp_path
    )
    for one, two, w1, w2 in steps[:2]:
        assert one["loss"] == two["loss"] and one["grad_norm"] > 0
        assert one["grad_norm"] == pytest.approx(two["grad_norm"], rel=1e-6)
        assert all(torch.equal(w1[k], w2[k]) for k in w1)
    one, two, w1, w2 = steps[2]
    assert one["loss"] == pytest.approx(two["loss"], rel=1e-5, abs=1e-7)
    assert one["tokens"] == two["tokens"] and one["gen_tokens"] == two["gen_tokens"]
    print(f"max |w1 - w2| after a padded step: {max_diff(w1, w2):.3g}")
    assert max_diff(w1, w2) < 1e-6


def test_ranks_publish_their_own_shards(tiny_policy_dir, tiny_tokenizer, tmp_path):
    """Two ranks each publish their own shards as a piece of every version (the snapshot, then
    deltas): no whole file is written, a receiver assembles the pieces into the gathered bf16
    snapshot bit for bit, and the tensors of a piece lost on the way are repaired one by one."""
    cfg = Config(rl=RLSection(lr=1e-2, micro_batch=4), trainer=TrainerSection(ParallelSection(fsdp=2)))
    root = str(tmp_path / "weights")
    sharded = start_trainer(cfg, str(tiny_policy_dir), router_replay, tiny_tokenizer.pad_token_id, root)
    try:
        sharded.publish()
        gathered = [sharded.bf16_state_dict()]
        for batch in step_batches(tiny_policy_dir, [8, 8]):
            sharded.step(batch)
            gathered.append(sharded.bf16_state_dict())
    finally:
        sharded.close()
    store = Store(root)
    assert [store.manifest(v).pieces for v in range(3)] == [2, 2, 2]
    assert sorted(p.rsplit("/", 1)[1] for p in store.fs.ls(f"{root}/deltas")) == [
        "00000001.p0.delta",
        "00000001.p1.delta",
        "00000002.p0.delta",
        "00000002.p1.delta",
    ]

    def assert_is(state, snapshot):
        assert sorted(state) == sorted(snapshot)
        for name, t in snapshot.items():
            assert state[name].data.tobytes() == t.view(torch.uint16).numpy().tobytes(), name

    replica = Replica.bootstrap(store)  # the snapshot's pieces, then each version's
    assert replica.version == 2
    assert_is(replica.state, gathered[2])
    behind = Replica({k: Tensor(t.dtype, t.shape, t.data.copy()) for k, t in store.state(1).items()}, 1)
    lost = store._delta_path(2, 1)
    rep = behind.advance(
        store,
        fetch=lambda v: b"".join(store._read(p) for p in store._paths("deltas", v, store.manifest(v)) if p != lost),
    )
    assert_is(behind.state, gathered[2])
    in_lost = {pieces.parse(e.name)[0] for e in codec.read_header(store._read(lost)).entries}
    assert rep.deltas == 1 and sorted(r.split(":", 1)[1] for r in rep.repaired) == sorted(in_lost)


def test_parallel_config_is_checked():
    assert load_config(overrides=["trainer.parallel.fsdp=4"]).trainer.parallel.fsdp == 4
    for bad in (
        "trainer.parallel.fsdp=0",
        "trainer.parallel.fsdp=2.5",
        "trainer.parallel.fsdp=true",
        "trainer.parallel.tp=2",
    ):
        with pytest.raises(UserError, match="trainer.parallel"):
            load_config(overrides=[bad])


def test_one_rank_group_is_the_identity():
    r = Ranks()
    assert r.share([1, 2, 3], lambda c: 0) == [(1, True), (2, True), (3, True)]
    assert Ranks(1, 2, mesh=object()).share([1, 2, 3], lambda c: -c) == [(2, True), (-1, False)]
    assert r.gather("x") == ["x"] and r.broadcast(5) == 5


@pytest.mark.slow
def test_four_ranks_and_a_resume_at_another_count(tiny_policy_dir, tiny_tokenizer, tmp_path):
    """Four ranks, an active clip, and steps of 4 and 6 micro-batches (two ranks pad the second)
    against one process: the norm and the gradients are summed in another order, so the weights
    agree to float32 rounding, not bitwise (bound 1e-5). Then a 2-rank trainer's checkpoint after
    the first step (each rank writes its shards), loaded by 4 ranks, runs the remaining steps to
    the same weights."""
    pad_id = tiny_tokenizer.pad_token_id
    rl = RLSection(lr=1e-2, micro_batch=2, grad_clip=0.05)
    batches = step_batches(tiny_policy_dir, [8, 12, 8])
    steps = compare(
        Config(rl=rl, trainer=TrainerSection(ParallelSection(fsdp=4))),
        tiny_policy_dir,
        pad_id,
        batches,
        tmp_path / "four",
    )
    for one, four, w1, w4 in steps:
        assert one["grad_norm"] > rl.grad_clip  # the clip is active
        assert one["grad_norm"] == pytest.approx(four["grad_norm"], rel=1e-5)
        assert one["loss"] == pytest.approx(four["loss"], rel=1e-5, abs=1e-7)
        print(f"4 ranks: max |w1 - w4| = {max_diff(w1, w4):.3g}")
        assert max_diff(w1, w4) < 1e-5

    two = start_trainer(
        Config(rl=rl, trainer=TrainerSection(ParallelSection(fsdp=2))),
        str(tiny_policy_dir),
        router_replay,
        pad_id,
        str(tmp_path / "two"),
    )
    try:
        two.publish()
        two.step(batches[0])
        two.save(tmp_path / "ckpt")
    finally:
        two.close()
    four = start_trainer(
        Config(rl=rl, trainer=TrainerSection(ParallelSection(fsdp=4))),
        str(tiny_policy_dir),
        router_replay,
        pad_id,
        str(tmp_path / "resumed"),
    )
    try:
        four.load(tmp_path / "ckpt")
        assert four.version == 1
        rows = [four.step(b) for b in batches[1:]]
        resumed = four.state_dict()["model"]
    finally:
        four.close()
    assert sorted(p.name for p in (tmp_path / "ckpt" / "shards").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert [r["version"] for r in rows] == [2, 3]
    print(f"2 -> 4 ranks: max |w1 - w| = {max_diff(steps[-1][2], resumed):.3g}")
    assert max_diff(steps[-1][2], resumed) < 1e-5
