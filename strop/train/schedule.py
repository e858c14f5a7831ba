"""The learning-rate schedule of mid-training and SFT: linear warmup, then a cosine from the peak
down to a floor (a fraction of the peak) at the last step; as a factor of the peak, for
`torch.optim.lr_scheduler.LambdaLR`."""

import math
from typing import Callable


def warmup_cosine(warmup_steps: int, total: Callable[[], int], min_ratio: float) -> Callable[[int], float]:
    """The factor at step k (from 0). `total()` is read at each step, since under a time budget the
    step count is chosen after the first steps; warmup does not depend on it. min_ratio 1 is constant."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total() - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
