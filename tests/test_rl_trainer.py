"""The RL trainer on a real tiny MoE: batches line up with segments, a toy reward goes up within
a few steps of sampling from the policy itself, router replay plugs in as a context, publish gets
every version in bf16, and a restored checkpoint repeats a step bitwise."""

import copy
import dataclasses
import time

import pytest
import torch

from strop.config import RLSection
from strop.env.episode import Segment
from strop.model.policy import build_model
from strop.model.routing import capture_routing, moe_blocks, replay_routing, stack_routing
from strop.rl.advantages import make_samples
from strop.rl.trainer import RLTrainer, build_batch
from strop.rl.trajectory import Trajectory, TrajectoryGroup
from tests.conftest import tiny_model_section

PROMPT = [11, 12, 13, 14]
TARGET = range(256, 320)  # the toy reward: how often the policy says one of these 64 of 512 ids


@torch.no_grad()
def sample_groups(
    model,
    version: int,
    n_groups: int,
    G: int,
    new_tokens: int,
    step: int,
    routing: bool = False,
    temperature: float = 1.0,
) -> list[TrajectoryGroup]:
    """Sample from `model` itself at `temperature` (full recompute per token); reward = fraction
    of TARGET tokens."""
    model.eval()
    rows = n_groups * G
    ids = torch.tensor([PROMPT] * rows)
    logps = []
    for _ in range(new_tokens):
        logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()
        lp = (logits / temperature).log_softmax(-1)
        tok = torch.multinomial(lp.exp(), 1)
        logps.append(lp.gather(1, tok))
        ids = torch.cat([ids, tok], 1)
    logps = torch.cat(logps, 1)
    routes = None
    if routing:  # the experts each position was routed through; a token records its producing position's
        with capture_routing(model) as records:
            model(input_ids=ids, use_cache=False)
        routes = stack_routing(records, tuple(ids.shape), model.config.num_experts).tolist()
    groups = []
    for g in range(n_groups):
        trajs = []
        for s in range(G):
            r = g * G + s
            seg = Segment(temperature=temperature)
            seg.add_forced(PROMPT)
            gen = ids[r, len(PROMPT) :].tolist()
            seg.add_generated(gen, logps[r].tolist(), [version] * new_tokens, None)
            if routes is not None:
                seg.routing = [None] + routes[r][:-1]
            reward = sum(t in TARGET for t in gen) / new_tokens
            trajs.append(Trajectory("toy", f"s{step}g{g}", s, [seg], reward, start_version=version))
        groups.append(TrajectoryGroup("toy", f"s{step}g{g}", G, trajs))
    model.train()
    return groups


@torch.no_grad()
def p_target(model) -> float:
    """The policy's probability mass on TARGET for the first response token."""
    model.eval()
    p = model(input_ids=torch.tensor([PROMPT]), use_cache=False).logits[0, -1].float().softmax(-1)
    model.train()
    return float(p[TARGET.start : TARGET.stop].sum())


def test_build_batch_aligns_targets_with_segments():
    a = Segment()
    a.add_forced([1, 2])
    a.add_generated([3, 4], [-0.5, -0.25], [0, 0], None)
    b = Segment()
    b.add_forced([5])
    b.add_generated([6], [-1.0], [0], None)
    batch = build_batch([(a, 2.0, 0.5), (b, -1.0, 0.25)], pad_id=0)
    assert batch.input_ids_BT.tolist() == [[1, 2, 3], [5, 6, 0]]
    assert batch.targets_BT.tolist() == [[2, 3, 4], [6, 0, 0]]
    assert batch.mask_BT.tolist() == [[False, True, True], [True, False, False]]
    assert batch.behavior_BT.tolist() == [[0.0, -0.5, -0.25], [-1.0, 0.0, 0.0]]
    assert batch.advantages_BT.tolist() == [[0.0, 2.0, 2.0], [-1.0, 0.0, 0.0]]
    assert batch.weights_BT.tolist() == [[0.0, 0.5, 0.5], [0.25, 0.0, 0.0]]
    assert batch.lengths_B.tolist() == [3, 1] and [len(r) for r in batch.routing] == [3, 1]


def test_policy_learns_a_toy_reward(tiny_moe, tiny_tokenizer):
    rl = RLSection(lr=2e-2, micro_batch=16, max_staleness=1, measure_every=3)
    published = []
    rows = []
    trainer = RLTrainer(
        tiny_moe,
        rl,
        pad_id=tiny_tokenizer.pad_token_id,
        publish=lambda v, sd: published.append((v, {t.dtype for t in sd.values()})),
        log=rows.append,
    )
    torch.manual_seed(0)
    before = p_target(trainer.model)
    t0 = time.perf_counter()
    for step in range(10):
        groups = sample_groups(trainer.model, trainer.version, 8, 8, 1, step)
        trainer.step(make_samples(groups, hack_penalty=rl.hack_penalty))
    after = p_target(trainer.model)
    print(
        f"p_target {before:.3f} -> {after:.3f}; rewards {[round(r['reward'], 3) for r in rows]}; "
        f"{time.perf_counter() - t0:.1f}s"
    )
    assert after > before + 0.25

    def mean(rs: list[dict]) -> float:
        return sum(r["reward"] for r in rs) / len(rs)

    assert mean(rows[-3:]) > mean(rows[:3]) + 0.1
    assert published == [(v, {torch.bfloat16}) for v in range(1, 11)] and trainer.version == 10
    # on-policy samples: the recomputed logprobs match the sampling ones
    assert (
        rows[0]["k3"] < 1e-6 and rows[0]["clip_frac"] == 0.0 and rows[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    )
    assert rows[0]["staleness_hist"] == {"0": 64} and rows[0]["tokens_per_s"] > 0
    assert rows[0]["mismatch_mean_abs_dlogp"] < 1e-4
    # the update is measured every 3rd step (its extra forward pass skipped on the others), and it
    # moved the rewarded samples' logprobs up
    measured = [i for i, r in enumerate(rows) if "update_rel" in r]
    assert measured == [0, 3, 6, 9] and all(rows[i]["update_rel"] > 0 for i in measured)
    assert sum(rows[i]["dlogp_pos"] for i in measured) > 0
    assert all(rows[i]["objective_gain"] > 0 for i in measured)  # lr 2e-2 on a toy reward: no overshoot


def test_objective_gain_tells_a_step_that_overshot(tiny_moe, tiny_tokenizer):
    """The same batch, one step at two learning rates: a small step raises the objective it followed,
    an AdamW step of 0.3 on every parameter overshoots and lowers it, and the metric says so."""
    torch.manual_seed(0)
    samples = make_samples(sample_groups(tiny_moe, 0, 4, 4, 8, 0))
    gains = {}
    for lr in (1e-4, 0.3):
        rl = RLSection(lr=lr, micro_batch=16, measure_every=1)
        trainer = RLTrainer(copy.deepcopy(tiny_moe), rl, pad_id=tiny_tokenizer.pad_token_id)
        gains[lr] = trainer.step(samples)["objective_gain"]
    assert gains[1e-4] > 0 > gains[0.3], gains


def test_reference_kl_anchors_the_policy(tiny_moe, tiny_tokenizer):
    """The same toy reward with and without the anchor to the starting policy: anchored, the policy
    moves less far from it, and the step reports how far (ref_kl)."""
    rl = RLSection(lr=2e-2, micro_batch=16, max_staleness=1, measure_every=0)
    with pytest.raises(ValueError, match="ref_kl_coef"):
        RLTrainer(tiny_moe, dataclasses.replace(rl, ref_kl_coef=1.0), pad_id=tiny_tokenizer.pad_token_id)
    moved, drift = [], []
    for coef in (0.0, 2.0):
        rows = []
        trainer = RLTrainer(
            copy.deepcopy(tiny_moe),
            dataclasses.replace(rl, ref_kl_coef=coef),
            pad_id=tiny_tokenizer.pad_token_id,
            log=rows.append,
            reference=copy.deepcopy(tiny_moe) if coef else None,
        )
        torch.manual_seed(0)
        before = p_target(trainer.model)
        for step in range(8):
            trainer.step(make_samples(sample_groups(trainer.model, trainer.version, 8, 8, 1, step)))
        moved.append(p_target(trainer.model) - before)
        drift.append([r["ref_kl"] for r in rows])
    assert moved[1] < moved[0]
    assert drift[0] == [0.0] * 8 and drift[1][0] == pytest.approx(0.0, abs=1e-6) and drift[1][-1] > 0


@pytest.mark.parametrize("temperature", [0.5, 1.5])
def test_trainer_scores_tokens_at_their_sampling_temperature(tiny_moe, tiny_tokenizer, temperature):
    rows = []
    trainer = RLTrainer(tiny_moe, RLSection(micro_batch=16), pad_id=tiny_tokenizer.pad_token_id, log=rows.append)
    torch.manual_seed(0)
    trainer.step(make_samples(sample_groups(trainer.model, 0, 2, 8, 4, 0, temperature=temperature), hack_penalty=1.0))
    # on-policy at T != 1: the engine's logprobs are of the tempered distribution, and so are the trainer's
    assert rows[0]["mismatch_mean_abs_dlogp"] < 1e-4 and rows[0]["clip_frac"] == 0.0


def test_rows_without_signal_run_forward_only(tiny_moe, tiny_tokenizer):
    """Samples with advantage 0 change nothing in the update (their loss is exactly 0) but still
    count in the step's metrics (up to `rl.idle_rows` of them are run); a step with no signal at
    all leaves the weights as they were."""
    from strop.rl.advantages import Sample

    rl = RLSection(lr=1e-2, micro_batch=16)
    torch.manual_seed(0)
    groups = sample_groups(tiny_moe, 0, 2, 4, 3, 0)
    signal = [Sample(t, a, 1 / 24, t.reward) for t, a in zip(groups[0].trajectories, [1.0, -1.0, 0.5, -0.5])]
    flat = [Sample(t, 0.0, 1 / 24, t.reward) for t in groups[1].trajectories]
    with_flat, alone = (RLTrainer(copy.deepcopy(tiny_moe), rl, pad_id=tiny_tokenizer.pad_token_id) for _ in range(2))
    row = with_flat.step(signal + flat)
    alone.step(signal)
    for (name, p), q in zip(with_flat.model.named_parameters(), alone.model.parameters()):
        torch.testing.assert_close(p, q, msg=name)
    assert row["no_signal_frac"] == 0.5 and row["gen_tokens"] == 24 and row["mismatch_mean_abs_dlogp"] < 1e-4

    before = copy.deepcopy(with_flat.model.state_dict())
    row = with_flat.step(flat)
    assert row["no_signal_frac"] == 1.0 and row["gen_tokens"] == 12 and with_flat.version == 2
    assert all(torch.equal(before[k], v) for k, v in with_flat.model.state_dict().items())
    full_cost = RLTrainer(
        copy.deepcopy(tiny_moe), dataclasses.replace(rl, skip_zero_advantage=False), pad_id=tiny_tokenizer.pad_token_id
    )
    assert full_cost.step(signal + flat)["no_signal_frac"] == 0.0
    capped = RLTrainer(
        copy.deepcopy(tiny_moe), dataclasses.replace(rl, idle_rows=2), pad_id=tiny_tokenizer.pad_token_id
    )
    row = capped.step(flat)  # only 2 of the 4 rows of advantage 0 are run, for the mismatch metrics
    assert row["no_signal_frac"] == 1.0 and row["gen_tokens"] == 6 and row["mismatch_mean_abs_dlogp"] < 1e-4


def test_stale_samples_are_importance_corrected(tiny_moe, tiny_tokenizer):
    """Samples from version 0 trained at version 2: ratios move off 1, staleness is reported; one
    version later they are past the bound and the trainer refuses them."""
    rl = RLSection(lr=2e-2, correction="icepop", mask_low=0.9, mask_high=1.1)
    trainer = RLTrainer(tiny_moe, rl, pad_id=tiny_tokenizer.pad_token_id)
    torch.manual_seed(0)
    old = sample_groups(trainer.model, 0, 2, 4, 4, 0)
    for step in range(2):
        trainer.step(make_samples(sample_groups(trainer.model, trainer.version, 2, 4, 4, step + 1)))
    row = trainer.step(make_samples(old))
    assert row["staleness_hist"] == {"2": 8} and row["staleness_max"] == 2
    assert row["k3"] > 1e-4 and row["mask_frac"] > 0
    with pytest.raises(AssertionError, match="staleness 3 > rl.max_staleness"):  # now 3 behind
        trainer.step(make_samples(old))


def test_router_replay_plugs_in_as_a_context(tiny_moe, tiny_tokenizer):
    """A replay function built on `replay_routing` runs once per micro-batch; routing recorded
    from the same weights reproduces the sampling logprobs, and wrong routing visibly does not."""
    calls = []

    def replay(shift: int):
        def ctx(model, batch):
            L, k = len(moe_blocks(model)), model.config.num_experts_per_tok
            pad = [[0] * k] * L
            width = batch.input_ids_BT.shape[1]
            rows = [[r if r is not None else pad for r in row] + [pad] * (width - len(row)) for row in batch.routing]
            calls.append(width)
            return replay_routing(model, (torch.tensor(rows) + shift) % model.config.num_experts)

        return ctx

    rl = RLSection(micro_batch=3, correction="none")
    torch.manual_seed(0)
    samples = make_samples(sample_groups(tiny_moe, 0, 2, 4, 3, 0, routing=True))
    right = RLTrainer(copy.deepcopy(tiny_moe), rl, pad_id=tiny_tokenizer.pad_token_id, replay_ctx=replay(0)).step(
        samples
    )
    assert len(calls) == 3  # 8 rows in micro-batches of 3
    assert right["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    wrong = RLTrainer(copy.deepcopy(tiny_moe), rl, pad_id=tiny_tokenizer.pad_token_id, replay_ctx=replay(1)).step(
        samples
    )
    assert wrong["k3"] > 1e-6 > 1e-9 > right["k3"]  # measured: 7e-6 vs 0.0 (bitwise equal logprobs)


def test_resume_repeats_a_step_bitwise(tiny_tokenizer, tmp_path):
    rl = RLSection(lr=1e-2, micro_batch=5)
    pad = tiny_tokenizer.pad_token_id
    a = RLTrainer(build_model(tiny_model_section(), tiny_tokenizer, seed=0), rl, pad_id=pad)
    torch.manual_seed(0)
    batches = [make_samples(sample_groups(a.model, 0, 2, 4, 3, s)) for s in range(3)]
    a.step(batches[0])
    a.save(tmp_path)
    rng = torch.get_rng_state()
    a.step(batches[1])
    a.step(batches[2])

    published = []
    b = RLTrainer(
        build_model(tiny_model_section(), tiny_tokenizer, seed=1),
        rl,
        pad_id=pad,
        publish=lambda v, sd: published.append((v, sd)),
    )
    b.load(tmp_path)
    assert torch.equal(torch.get_rng_state(), rng)
    b.step(batches[1])
    b.step(batches[2])
    assert b.version == a.version == 3 and [v for v, _ in published] == [2, 3]
    for (name, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(x, y), name
    assert all(torch.equal(published[-1][1][k], v) for k, v in a.bf16_state_dict().items())
