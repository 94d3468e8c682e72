"""How long a step of N tokens takes on this engine, learned from the steps it has run.

A step's time is close to linear in its scheduled tokens: a fixed part (the decode batch
reading every weight once, Python, the sampler) plus a per-token part (matmul FLOPs). The
scheduler asks the inverse question — how many tokens fit in a time — to keep steps that
carry decodes under a target, so one long prompt's chunk cannot stall every stream's next
token (on a CPU a 2,048-token chunk of a 135M model is several seconds).

The fit is ordinary least squares over a sliding window of recent steps, so it follows the
machine (another job taking a core, a warmer cache) without any per-device table. Until the
window has seen steps of different sizes there is no slope to trust, and the answer is None:
the scheduler then keeps its static budget. Once fitted, the last good fit stands in whenever
the window cannot be fitted again — which the budget itself causes: steps shaped to one time
target all have about the same size, and a window of equal sizes has no slope.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

MIN_OBSERVATIONS = 4  # steps seen before the fit is used
MIN_TOKEN_SPREAD = 8  # the window's step sizes must differ by this much for a slope
# Share of a TBT target a step may take. A token gap is the step plus what runs between steps
# (scheduling, update, sending the output), and the fit predicts a mean step while the target
# binds a tail: a fifth is left for both.
TBT_STEP_SHARE = 0.8


def step_time_target_s(max_step_ms: float, tbt_targets_s: Iterable[float | None]) -> float | None:
    """Seconds a step carrying these decodes should take at most: max_step_ms (0 = none) or
    TBT_STEP_SHARE of the smallest TBT target among them (None = no target), whichever is
    smaller; None when neither applies."""
    targets = [TBT_STEP_SHARE * t for t in tbt_targets_s if t is not None]
    if max_step_ms > 0:
        targets.append(max_step_ms / 1000.0)
    return min(targets, default=None)


@dataclass
class StepCostModel:
    window: int = 64  # most recent steps kept
    _steps: deque[tuple[int, float]] = field(init=False)  # (tokens, seconds), the last `window`
    _last_fit: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        self._steps = deque(maxlen=self.window)

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0 and seconds > 0:
            self._steps.append((num_tokens, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), both >= 0; None while the window cannot tell them apart."""
        if len(self._steps) < MIN_OBSERVATIONS:
            return None
        xs = [float(n) for n, _ in self._steps]
        ys = [s for _, s in self._steps]
        if max(xs) - min(xs) < MIN_TOKEN_SPREAD:
            return None
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        var_x = sum((x - mean_x) ** 2 for x in xs)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var_x
        if slope <= 0:  # noise swamped the per-token cost: no basis for a token count
            return None
        self._last_fit = (max(0.0, mean_y - slope * mean_x), slope)
        return self._last_fit

    def current(self) -> tuple[float, float] | None:
        """The fit the scheduler uses: the window's own, else the last good one; None before any."""
        return self.fit() or self._last_fit

    def tokens_within(self, seconds: float, max_fixed_share: float | None = None) -> int | None:
        """Most tokens a step may schedule to take at most `seconds` (0 if even the fixed part
        is over it); None while the model has no fit. With `max_fixed_share`, never fewer than
        the tokens at which the fixed part is that share of the step (a bound below the fixed
        part would otherwise cut steps to nothing and pay the fixed part for every few tokens)."""
        fitted = self.current()
        if fitted is None:
            return None
        fixed, per_token = fitted
        tokens = max(0, int((seconds - fixed) / per_token + 1e-9))  # + epsilon: 17.999… fits 18
        if max_fixed_share is not None:
            tokens = max(tokens, int(fixed * (1.0 - max_fixed_share) / (max_fixed_share * per_token) + 1e-9))
        return tokens
