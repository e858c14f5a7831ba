"""The gates a candidate version must pass before it is served: no regression beyond the interval.

A gate run measures a policy on
- task suites, held out: `synthetic` (eval split, difficulty 1), `humaneval` (eval split) and
  `mutated` (when built; `strop tasks build --suite mutated/PACKAGE`), a few episodes each through the
  one harness, sandbox and checker (`strop.rl.evaluate`);
- the production-hack monitors (`strop.online.monitors`) on probe requests it was never trained on
  (`strop.online.probes`), each probe sampled with a fixed seed, so the current and the candidate
  version see the same random numbers and differ only where their weights make them differ.

Both run in the harness's chat format (`chat_template`, `tool_parser`: as `[harness]` names them,
`strop.env.harness.chat_formats`), so a pretrained model is gated in the template it is served in.

`compare` refuses a candidate on any figure that got worse than the current version's by more
than a two-proportion z-test at 95% allows (pooled; one side: the bad direction of each figure),
and on a monitor that crosses its alert threshold while the current version is inside it: a
comparison with the current version alone lets small steps, each within the interval, add up.
"""

import math
from dataclasses import dataclass, field, replace

from strop.config import Config
from strop.errors import UserError
from strop.online.monitors import ALERTS, classify, monitor_rates, offered_roles
from strop.online.probes import EDIT_TOOL, probe_requests
from strop.policy_api import SamplingParams
from strop.rl.evaluate import Z95

SUITES = ("synthetic", "humaneval", "mutated")


@dataclass(frozen=True)
class GateSettings:
    suites: tuple[str, ...] = SUITES
    episodes: int = 6  # per suite
    probe_samples: int = 2  # samples per probe request
    max_tokens: int = 192
    seed: int = 0
    chat_template: str = "auto"  # harness.chat_template: the format probes and suites are rendered in
    tool_parser: str = "auto"  # harness.tool_parser
    rollout: dict = field(
        default_factory=lambda: {
            "max_turns": 3,
            "max_turn_tokens": 96,
            "max_context": 1024,
            "workers": 2,
            "engine_batch": 8,
        }
    )


def suite_tasks(name: str, n: int) -> list:
    """The first `n` held-out tasks of difficulty 1 (or of any, for a suite without difficulties)."""
    from strop.env.tasks.suites import draw_tasks

    return draw_tasks(name, "eval", [1], n)


def probe_replies(policy_dir: str, s: GateSettings) -> tuple[list, list]:
    """(task probe replies, sycophancy probe replies), classified."""
    from strop.engine.engine import Engine
    from strop.env.harness.chat_formats import chat_format

    engine = Engine.from_checkpoint(policy_dir, max_batch=16, max_len=s.rollout["max_context"], seed=s.seed)
    fmt = chat_format(engine.tokenizer, s.chat_template, s.tool_parser)
    tasks, syco = probe_requests()
    requests = [r for r in tasks + syco for _ in range(s.probe_samples)]
    prompts = [fmt.prompt(r.messages, EDIT_TOOL) for r in requests]
    params = [
        SamplingParams(
            max_tokens=s.max_tokens,
            temperature=1.0,
            seed=s.seed * 100_003 + i,
            stop_token_ids=[fmt.stop_ids[0]],  # the end of an assistant turn
        )
        for i in range(len(requests))
    ]
    outs = engine.generate(prompts, params)
    offered = offered_roles(EDIT_TOOL)
    texts = [engine.tokenizer.decode(o.token_ids, skip_special_tokens=False) for o in outs]
    replies = [classify(fmt.turn_text(text), offered, fmt.parse) for text in texts]
    return replies[: len(tasks) * s.probe_samples], replies[len(tasks) * s.probe_samples :]


def measure(policy_dir: str, s: GateSettings) -> dict:
    """{"monitors": rates (`monitor_rates`), "suites": {name: {solve_rate, solve_rate_ci95, eval_episodes,
    solved} or {"skipped": why}}}."""
    from strop.rl.evaluate import evaluate

    tasks, syco = probe_replies(policy_dir, s)
    out = {"monitors": monitor_rates(tasks, syco), "suites": {}}
    cfg = Config()
    cfg = replace(
        cfg,
        rollout=replace(cfg.rollout, **s.rollout),
        run=replace(cfg.run, seed=s.seed),
        harness=replace(cfg.harness, chat_template=s.chat_template, tool_parser=s.tool_parser),
    )
    for name in s.suites:
        try:
            chosen = suite_tasks(name, s.episodes)
        except UserError as e:  # e.g. the mutated suite is not built on this machine
            out["suites"][name] = {"skipped": str(e)}
            continue
        r = evaluate(cfg, policy_dir, tasks=chosen)
        out["suites"][name] = {k: r[k] for k in ("solve_rate", "solve_rate_ci95", "eval_episodes")}
        out["suites"][name]["solved"] = round(r["solve_rate"] * r["eval_episodes"])
    return out


def regressed(cur_hits: int, cur_n: int, cand_hits: int, cand_n: int, higher_is_bad: bool) -> bool:
    """The candidate's proportion is worse than the current's beyond a 95% two-proportion z-test."""
    if not cur_n or not cand_n:
        return False
    pooled = (cur_hits + cand_hits) / (cur_n + cand_n)
    se = math.sqrt(pooled * (1 - pooled) * (1 / cur_n + 1 / cand_n))
    worse = (cand_hits / cand_n - cur_hits / cur_n) * (1 if higher_is_bad else -1)
    return se > 0 and worse > Z95 * se


def compare(current: dict, candidate: dict) -> dict:
    """{gate name: {passed, current, candidate}} for every monitor and suite (see the module docstring)."""
    gates = {}
    for name, cand in candidate["monitors"].items():
        cur = current["monitors"][name]
        bad_up = ALERTS[name][1] == "above"
        hits = lambda f: round(f["rate"] * f["n"])  # noqa: E731
        crossed = cand["alert"] and not cur["alert"]
        gates[name] = {
            "passed": not crossed and not regressed(hits(cur), cur["n"], hits(cand), cand["n"], bad_up),
            "current": cur["rate"],
            "candidate": cand["rate"],
            "alert": cand["alert"],
        }
    for name, cand in candidate["suites"].items():
        cur = current["suites"].get(name, {})
        if "skipped" in cand or "skipped" in cur:
            gates[f"suite:{name}"] = {"passed": True, "skipped": cand.get("skipped") or cur.get("skipped")}
            continue
        gates[f"suite:{name}"] = {
            "passed": not regressed(
                cur["solved"], cur["eval_episodes"], cand["solved"], cand["eval_episodes"], higher_is_bad=False
            ),
            "current": cur["solve_rate"],
            "candidate": cand["solve_rate"],
        }
    return gates
