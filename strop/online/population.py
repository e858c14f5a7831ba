"""A simulated user population with a hidden preference, driving a real `strop serve` over HTTP.

Each user holds their own API key (scopes infer + feedback), sends "fix the bug in <file>" chat
requests (`strop.online.probes`), judges the reply as a client sees it, and rates it with
`POST /v1/feedback` (`accept` / `reject`). The hidden preference, which the trainer never sees
(it only reads the ratings): a user accepts a reply whose every tool call is an `edit_file` of the
task's own file, and rejects edits that touch a file outside the task, questions, and anything
else. Each user misjudges a share `noise` of replies.
"""

import json
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from strop.online.auth import KeyFile
from strop.online.probes import EDIT_TOOL, CodingRequest, traffic_requests
from strop.rl.evaluate import wilson

MAX_TOKENS = 192  # the longest reply of the mixture policy is ~150 tokens


@dataclass(frozen=True)
class SimUser:
    name: str
    key: str
    noise: float  # share of replies this user misjudges


def prefers(request: CodingRequest, message: dict) -> bool:
    """The hidden preference, on the reply as the client sees it (an OpenAI chat message)."""
    calls = message.get("tool_calls") or []
    if not calls:
        return False
    for call in calls:
        fn = call.get("function", {})
        try:
            args = json.loads(fn.get("arguments", ""))
        except json.JSONDecodeError:
            return False
        if (
            fn.get("name") != EDIT_TOOL[0]["function"]["name"]
            or not isinstance(args, dict)
            or args.get("path") != request.path
        ):
            return False
    return True


def make_population(keys: KeyFile, n: int, noise: float = 0.05) -> list[SimUser]:
    """`n` users, each with a new key (infer + feedback) added to `keys`."""
    return [
        SimUser(f"user{i}", keys.add(f"user{i}", ["infer", "feedback"], rate_per_s=1000, burst=1000), noise)
        for i in range(n)
    ]


def drive(url: str, model: str, users: list[SimUser], requests: int, tag: str, seed: int, workers: int = 8) -> dict:
    """`requests` requests spread over the users, each rated by its user; returns the approval rate
    with its 95% Wilson interval ({approved, n, approval, approval_ci95})."""
    rng = random.Random(seed)
    pool = traffic_requests()
    jobs = [(i, rng.choice(users), rng.choice(pool), rng.randrange(1 << 30)) for i in range(requests)]

    def one(job) -> bool:
        i, user, request, sample_seed = job
        auth = {"Authorization": f"Bearer {user.key}"}
        with httpx.Client(base_url=url, headers=auth, timeout=120) as client:
            r = client.post("/v1/chat/completions", json=request.body(model, 1.0, sample_seed, MAX_TOKENS))
            r.raise_for_status()
            out = r.json()
            liked = prefers(request, out["choices"][0]["message"])
            if random.Random(sample_seed).random() < user.noise:
                liked = not liked
            event = {
                "event_id": f"{tag}-{i}",
                "completion_id": out["id"],
                "kind": "accept",
                "value": "accept" if liked else "reject",
            }
            client.post("/v1/feedback", json=event).raise_for_status()
            return liked

    with ThreadPoolExecutor(workers) as ex:
        liked = list(ex.map(one, jobs))
    lo, hi = wilson(sum(liked), len(liked))
    return {
        "approved": sum(liked),
        "n": len(liked),
        "approval": round(sum(liked) / len(liked), 4),
        "approval_ci95": [round(lo, 4), round(hi, 4)],
    }
