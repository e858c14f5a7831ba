"""Users' ratings of served completions as RL rewards.

The default is Tab-style (Cursor's online RL for Tab: +0.75 for an accepted suggestion, -0.25 for a
rejected one, 0 for staying silent); every positive rating counts as an accept, every negative one
as a reject. A map is configurable as `kind.value=reward` pairs, e.g. `accept.reject=-0.5`.
A completion rated more than once counts its latest rating only.
"""

from dataclasses import dataclass, field

from strop.online.feedback import VALUES

TAB_STYLE = {
    ("thumbs", "up"): 0.75,
    ("thumbs", "down"): -0.25,
    ("accept", "accept"): 0.75,
    ("accept", "reject"): -0.25,
    ("edit", "kept"): 0.75,
    ("edit", "reverted"): -0.25,
}


@dataclass(frozen=True)
class RewardMap:
    rewards: dict[tuple[str, str], float] = field(default_factory=lambda: dict(TAB_STYLE))

    def __call__(self, kind: str, value: str) -> float:
        return self.rewards[(kind, value)]

    @classmethod
    def parse(cls, text: str) -> "RewardMap":
        """Tab-style, with `kind.value=reward,...` overriding some entries; ValueError naming a bad one."""
        rewards = dict(TAB_STYLE)
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, number = part.partition("=")
            kind, _, value = key.strip().partition(".")
            if not sep or value not in VALUES.get(kind, ()):
                raise ValueError(
                    f"reward {part!r}: write kind.value=reward with kind.value one of "
                    f"{', '.join(f'{k}.{v}' for k, v in TAB_STYLE)}"
                )
            try:
                rewards[(kind, value)] = float(number)
            except ValueError:
                raise ValueError(f"reward {part!r}: {number.strip()!r} is not a number") from None
        return cls(rewards)
