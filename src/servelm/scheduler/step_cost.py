"""How long a step takes on this engine, learned from the steps it has run.

A step's time is close to linear in two counts: its scheduled tokens, and the attention pairs of
its prompt chunks (each new prompt token against every earlier token of its prompt). The fixed
part is the decode batch reading every weight once, Python, the sampler; a token costs its
matmul FLOPs; a pair costs the attention's. Tokens alone priced a chunk deep in a long prompt
like one at its start: a 148-token chunk after 3,640 cached tokens, planned at 200 ms next to a
decode, took 408 ms (2 CPU cores, the default model), and a stream decoding beside a 4,000-token
prefill waited 301 ms a token at the median under a 200 ms bound (benchmarks/step_time_target.py;
212 ms with pairs priced). The scheduler asks the inverse question — how many
tokens of a chunk at a given context fit in a time — to keep steps that carry decodes under a
target, so one long prompt's chunk cannot stall every stream's next token (on a CPU a
2,048-token chunk of a 135M model is several seconds).

The fit is ordinary least squares over a sliding window of recent steps, so it follows the
machine (another job taking a core, a warmer cache) without any per-device table. Until the
window has seen steps of different sizes there is no slope to trust, and the answer is None:
the scheduler then keeps its static budget. Once fitted, the last good fit stands in whenever
the window cannot be fitted again — which the budget itself causes: steps shaped to one time
target all have about the same size, and a window of equal sizes has no slope. The pair cost
needs chunks at different depths to be told from the token cost; a window without them (decodes
only, or chunks whose pairs move with their tokens) keeps the last pair cost and fits the rest.
"""

from __future__ import annotations

import math
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


def chunk_pairs(num_new: int, num_computed: int) -> int:
    """Attention pairs of a prompt chunk of `num_new` tokens after `num_computed` of its prompt:
    each new token against the context and the new tokens before it."""
    return num_new * num_computed + num_new * (num_new - 1) // 2


@dataclass
class StepCostModel:
    window: int = 64  # most recent steps kept
    _steps: deque[tuple[int, int, float]] = field(init=False)  # (tokens, pairs, seconds), the last `window`
    _last_fit: tuple[float, float] | None = None
    _per_pair: float = 0.0  # seconds per attention pair: the last fit that could tell it apart
    # fit()'s answer for the window as it stands: the scheduler asks several times a step, and the
    # window changes only in observe(), which marks it stale
    _window_fit: tuple[float, float] | None = None
    _window_fit_stale: bool = True

    def __post_init__(self) -> None:
        self._steps = deque(maxlen=self.window)

    @property
    def per_pair_s(self) -> float:
        """Seconds one attention pair of a prompt chunk adds (0 until a window told it apart)."""
        return self._per_pair

    def observe(self, num_tokens: int, seconds: float, num_pairs: int = 0) -> None:
        """One step's time: its scheduled tokens and its prompt chunks' pairs (chunk_pairs)."""
        if num_tokens > 0 and seconds > 0:
            self._steps.append((num_tokens, max(0, num_pairs), seconds))
            self._window_fit_stale = True

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), both >= 0; None while the window cannot tell them
        apart. Refits the pair cost (per_pair_s) too when the window can tell it apart."""
        if self._window_fit_stale:
            self._window_fit, self._window_fit_stale = self._fit_window(), False
        return self._window_fit

    def _fit_window(self) -> tuple[float, float] | None:
        if len(self._steps) < MIN_OBSERVATIONS:
            return None
        xs = [float(n) for n, _, _ in self._steps]
        if max(xs) - min(xs) < MIN_TOKEN_SPREAD:
            return None
        ps = [float(p) for _, p, _ in self._steps]
        ys = [s for _, _, s in self._steps]
        with_pairs = _fit_two(xs, ps, ys)
        if with_pairs is not None:
            intercept, slope, self._per_pair = with_pairs
        else:
            # Tokens alone, the known pair cost taken off first (else a window of deep chunks
            # would raise every token's price by their attention).
            net = [y - self._per_pair * p for y, p in zip(ys, ps)]
            mean_x, mean_y = sum(xs) / len(xs), sum(net) / len(net)
            var_x = sum((x - mean_x) ** 2 for x in xs)
            slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, net)) / var_x
            if slope <= 0:  # noise swamped the per-token cost: no basis for a token count
                return None
            intercept = mean_y - slope * mean_x
        self._last_fit = (max(0.0, intercept), slope)
        return self._last_fit

    def current(self) -> tuple[float, float] | None:
        """The fit the scheduler uses: the window's own, else the last good one; None before any."""
        return self.fit() or self._last_fit

    def predict(self, num_tokens: int, num_pairs: int = 0) -> float | None:
        """Seconds a step of `num_tokens` scheduled tokens whose prompt chunks have `num_pairs`
        attention pairs should take; None while the model has no fit."""
        fitted = self.current()
        if fitted is None:
            return None
        fixed, per_token = fitted
        return fixed + per_token * num_tokens + self._per_pair * num_pairs

    def prompt_blocks_s(self, block_size: int, first_depth: int, num_blocks: int) -> list[float] | None:
        """What computing each of `num_blocks` prompt blocks adds to a step, the first starting
        after `first_depth` tokens of its prompt: its tokens and its attention pairs at its depth
        (no fixed part: the step runs anyway). None while the model has no fit."""
        fitted = self.current()
        if fitted is None:
            return None
        per_token = fitted[1]
        return [
            per_token * block_size + self._per_pair * chunk_pairs(block_size, first_depth + i * block_size)
            for i in range(num_blocks)
        ]

    def tokens_within(
        self, seconds: float, max_fixed_share: float | None = None, context: int | None = None
    ) -> int | None:
        """Most tokens a step may schedule to take at most `seconds` (0 if even the fixed part
        is over it), priced as one prompt chunk after `context` tokens of its prompt (None: tokens
        without attention pairs, as decodes); None while the model has no fit. With
        `max_fixed_share`, never fewer than the tokens at which the fixed part is that share of
        the step (a bound below the fixed part would otherwise cut steps to nothing and pay the
        fixed part for every few tokens)."""
        fitted = self.current()
        if fitted is None:
            return None
        fixed, per_token = fitted
        tokens = _largest_chunk(seconds - fixed, per_token, 0.0 if context is None else self._per_pair, context or 0)
        if max_fixed_share is not None:
            tokens = max(tokens, int(fixed * (1.0 - max_fixed_share) / (max_fixed_share * per_token) + 1e-9))
        return tokens


# Least independent spread the pairs need beside the tokens: 1 - their correlation² over the
# window. Below it the two slopes trade off against each other and noise decides them.
_MIN_PAIR_INDEPENDENCE = 0.05


def _fit_two(xs: list[float], ps: list[float], ys: list[float]) -> tuple[float, float, float] | None:
    """OLS of ys on tokens xs and pairs ps: (intercept, per token, per pair), both slopes > 0;
    None when the pairs do not vary apart from the tokens or a slope comes out non-positive."""
    n = len(xs)
    mx, mp, my = sum(xs) / n, sum(ps) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    spp = sum((p - mp) ** 2 for p in ps)
    sxp = sum((x - mx) * (p - mp) for x, p in zip(xs, ps))
    if spp <= 0 or sxx <= 0:
        return None
    det = sxx * spp - sxp * sxp
    if det < _MIN_PAIR_INDEPENDENCE * sxx * spp:
        return None
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    spy = sum((p - mp) * (y - my) for p, y in zip(ps, ys))
    per_token = (spp * sxy - sxp * spy) / det
    per_pair = (sxx * spy - sxp * sxy) / det
    if per_token <= 0 or per_pair <= 0:
        return None
    return my - per_token * mx - per_pair * mp, per_token, per_pair


def _largest_chunk(seconds: float, per_token: float, per_pair: float, context: int) -> int:
    """Largest n with per_token·n + per_pair·chunk_pairs(n, context) <= seconds (0 if none)."""
    if seconds <= 0:
        return 0
    linear = per_token + per_pair * (context - 0.5)  # chunk_pairs = n·context + n²/2 - n/2
    if per_pair <= 0:
        return max(0, int(seconds / per_token + 1e-9))  # + epsilon: 17.999… fits 18
    half = per_pair / 2.0
    root = (-linear + math.sqrt(linear * linear + 4.0 * half * seconds)) / (2.0 * half)
    tokens = max(0, int(root + 1e-9))
    while tokens > 0 and per_token * tokens + per_pair * chunk_pairs(tokens, context) > seconds * (1 + 1e-9):
        tokens -= 1  # the root's rounding, never more than a token or two
    return tokens
