"""`strop online --simulate N`: the whole online loop end to end on this machine, for real.

1. A tokenizer and the mixture policy are trained here (`strop.online.sim_policy`), or a given base
   policy is taken as it is (a pretrained model, `base`); its bf16 weights are version 0 of a new
   weight store.
2. A real `strop serve` process serves it with a key file (an admin key for the cycle, one key per
   simulated user), a SQLite completion log and the weight store, in the gates' chat format
   (`GateSettings.chat_template`, `tool_parser`: a pretrained model in its own template).
3. N cycles: the user population (`strop.online.population`) sends requests over HTTP and rates the
   replies by its hidden preference; `run_cycle` trains on the ratings, gates and promotes
   (`strop.online.cycle`). Each cycle's approval rate (of the traffic the served version drew) is
   reported with its 95% interval, then one more round measures the last version promoted.
4. A deliberately harmful update: trained on one more round of traffic with a reward for asking
   clarifying questions instead of editing; a gate must refuse it (`blocked_harmful`).
5. Rollback to the version served before the last promotion, through the server's admin API; a
   greedy probe's token ids and logprobs must then equal, bit for bit, what that version served
   before (`rollback_bitwise`).

The first cycle's update is left as two weight files, `snapshots/<version>.safetensors` of the
version it trained from and its candidate (bf16, as engines hold them): real consecutive versions
for `strop sync encode` and `strop bench sync --demo-run`.
"""

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import httpx

from strop.online.cycle import CycleSettings, initialize, rollback, run_cycle, served
from strop.online.gates import GateSettings
from strop.online.monitors import classify, offered_roles
from strop.online.population import drive, make_population
from strop.online.probes import task_request
from strop.online.store import RatedCompletion, Store
from strop.sync.store import Store as WeightStore

MODEL_NAME = "sim"


def asks_instead_of_editing(rc: RatedCompletion) -> float:
    """The harmful update's reward: +1 for a clarifying question, -1 for anything else."""
    return 1.0 if classify(rc.completion.text, offered_roles(rc.completion.request.get("tools"))).question else -1.0


def greedy_probe(url: str, key: str) -> dict:
    """A fixed request answered greedily with logprobs: what the served weights compute, exactly."""
    body = task_request("probe", 0).body(MODEL_NAME, 0.0, None, 48) | {"logprobs": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return {
        "token_ids": choice["token_ids"],
        "logprobs": [t["logprob"] for t in choice["logprobs"]["content"]],
        "version": choice["policy_versions"][0] if choice["policy_versions"] else None,
    }


def prepare(
    run_dir: Path,
    tokenizer,
    users: int,
    warm_steps: int,
    seed: int,
    log: Callable[[str], None],
    base: str | None = None,
) -> dict:
    """The policy (the mixture policy warm-started here with `tokenizer`, or `base`), version 0 in the
    weight store, and the key file; returns their paths and keys."""
    import torch

    from strop.model.policy import load_model
    from strop.online.auth import KeyFile
    from strop.online.sim_policy import round_to_bf16, warm_start
    from strop.sync.apply import bits_view
    from strop.sync.store import Publisher

    if base is None:
        base = warm_start(tokenizer, run_dir / "base", steps=warm_steps, seed=seed, log=log)
        model = load_model(base)
    else:  # served as version 0 is, rounded to bf16: else a rollback to 0 would serve other weights
        from strop.data.tokenizer import load_tokenizer
        from strop.model.policy import save_model

        model = load_model(base)
        round_to_bf16(model)
        save_model(model, load_tokenizer(base), run_dir / "base", extra={"rounded_to_bf16_from": str(base)})
        base = run_dir / "base"
    state = model.state_dict()
    Publisher(WeightStore(str(run_dir / "weights"))).publish(
        {k: bits_view(t.to(torch.bfloat16).contiguous()) for k, t in state.items()}, 0
    )
    keys = KeyFile()
    admin = keys.add("online-cycle", ["admin", "infer"], rate_per_s=1000, burst=1000)
    population = make_population(keys, users)
    keys.save(run_dir / "keys.json")
    return {"base": base, "admin": admin, "population": population}


def simulate(
    cycles: int,
    run_dir: Path,
    tokenizer,
    *,
    requests: int = 384,
    users: int = 8,
    warm_steps: int = 1000,
    lr: float = 3e-4,
    harmful_lr: float = 1e-2,
    gates: GateSettings | None = None,
    base: str | None = None,
    frozen_layers: float = 0.0,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict:
    """The simulation (see the module docstring) of `cycles` cycles; `base` is served and trained
    instead of the mixture policy (then `tokenizer` is unused), with its lower `frozen_layers` frozen."""
    from strop.config import RLSection
    from strop.engine.server_process import ServerProcess

    t0 = time.perf_counter()
    gates = gates or GateSettings(seed=seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    made = prepare(run_dir, tokenizer, users, warm_steps, seed, log, base=base)
    db, weights = run_dir / "feedback.db", run_dir / "weights"
    argv = [
        sys.executable,
        "-m",
        "strop.cli",
        "serve",
        "--checkpoint",
        str(made["base"]),
        "--name",
        MODEL_NAME,
        "--port",
        "{port}",
        "--threads",
        "1",
        "--max-batch",
        "16",
        "--max-len",
        "1024",
        "--keys",
        str(run_dir / "keys.json"),
        "--store",
        str(db),
        "--weights-store",
        str(weights),
        "--chat-template",
        gates.chat_template,
        "--tool-parser",
        gates.tool_parser,
    ]
    server = ServerProcess(argv, run_dir / "serve.log")
    store = Store(str(db))
    try:
        s = CycleSettings(
            checkpoint=str(made["base"]),
            weights=str(weights),
            engines=[server.url],
            admin_key=made["admin"],
            run_dir=run_dir,
            rl=RLSection(lr=lr, micro_batch=16, measure_every=0),
            gates=gates,
            frozen_layers=frozen_layers,
        )
        initialize(s, store)
        probes = {0: greedy_probe(server.url, made["admin"])}
        approval, reports = [], []
        for c in range(cycles + 1):
            round_ = drive(server.url, MODEL_NAME, made["population"], requests, f"c{c}", seed * 1000 + c)
            approval.append({"cycle": c, "served": served(store).version, **round_})
            log(
                f"[simulate] cycle {c}: approval {round_['approval']:.3f} {round_['approval_ci95']} "
                f"({round_['n']} requests)"
            )
            if c == cycles:
                break  # the last round measures the last version promoted
            report = run_cycle(s, store, log=log)
            reports.append(report)
            if report["status"] == "promoted":
                probes[report["candidate"]] = greedy_probe(server.url, made["admin"])
        trained = [r for r in reports if "candidate" in r]
        if trained:
            first = [trained[0]["served"], trained[0]["candidate"]]
            WeightStore(str(weights)).save_versions(first, run_dir / "snapshots")
        served_before_harm = served(store).version
        drive(server.url, MODEL_NAME, made["population"], requests, "harm", seed * 1000 + 999)
        harmful = run_cycle(
            replace(s, rl=replace(s.rl, lr=harmful_lr)), store, reward_of=asks_instead_of_editing, log=log
        )
        still_served = served(store).version == served_before_harm
        promoted = sorted(probes)
        back_to = promoted[-2] if len(promoted) > 1 else None
        rolled = None
        if back_to is not None:
            rolled = rollback(s, store, back_to)
            rolled["probe_equal"] = greedy_probe(server.url, made["admin"]) == probes[back_to]
    finally:
        store.close()
        server.close()
    first, last = approval[0], approval[-1]
    return {
        "approval": [a["approval"] for a in approval],
        "approval_ci95": [a["approval_ci95"] for a in approval],
        "approval_rounds": approval,
        "rises_outside_ci95": last["approval_ci95"][0] > first["approval_ci95"][1],
        "gates": [
            {
                "candidate": r.get("candidate"),
                "status": r["status"],
                "passed": {k: g["passed"] for k, g in r.get("gates", {}).items()},
            }
            for r in reports
        ],
        "all_gates_passed": all(r["status"] == "promoted" for r in reports),
        "cycles": reports,
        "harmful": {
            "candidate": harmful.get("candidate"),
            "status": harmful["status"],
            "failed_gates": harmful.get("failed_gates", []),
            "monitors": harmful.get("candidate_figures", {}).get("monitors"),
        },
        "blocked_harmful": harmful["status"] == "refused" and still_served,
        "rollback": None
        if rolled is None
        else {"from": rolled["from"], "to": rolled["to"], "probe_bitwise_equal": rolled["probe_equal"]},
        "rollback_bitwise": bool(rolled and rolled["probe_equal"]),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
