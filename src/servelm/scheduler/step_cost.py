"""How long a step takes on this engine: a cost model calibrated at start-up and refined by every step.

A step's time is close to linear in a few counts of what it computes (`StepShape`):

    seconds = fixed                                   Python, sampling, the LM head, launching
            + per_pass        x dense passes          a prompt forward reads every weight once
            + per_decode      x decode tokens         a decode row: its matmul rows, its sampling
            + per_decode_ctx  x decode context        ... its attention reads its whole context
            + per_token       x prompt tokens         a prompt token's matmul FLOPs
            + per_pair        x prompt pairs          each new token against every earlier token
            + per_chunk_ctx   x chunk context         a chunk after cached context reads all of it

The last term is what a model of tokens and pairs alone missed: a small chunk deep in a long
prompt pays for reading its whole context again, whatever its size (on 2 AMD cores and the
default model, a 16-token chunk after 6,144 tokens took 214 ms against 48 ms at the prompt's
start, 4x what its pairs predict). A layer slice of a chunk (layered prefill) is the fraction of
its chunk's counts its layers are; so counts are floats.

The coefficients are non-negative least squares, each step weighted by 1/seconds² (relative
error is what the scheduler's bound cares about: a 5 ms decode matters as much as a 3 s
prompt), over the steps a start-up calibration timed (worker/warmup.py: prompts of several sizes,
chunks after cached context at several depths, decodes of several rows; kept as the prior, worth
`PRIOR_WEIGHT` of the window) and the last `window` steps the engine ran. So it starts right on
any machine, without a table of devices, and follows the machine as it drifts (another job on a
core, a warmer cache). A count the window never varies keeps its calibrated price.

The scheduler asks it what a step of a given shape costs (`predict`), and derives from it the
largest chunk or the most layers that keep a step within its time target (step_pricing.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields

# Share of a TBT target a step may take. A token gap is the step plus what runs between steps
# (scheduling, update, sending the output), and the model predicts a mean step while the target
# binds a tail: a fifth is left for both.
TBT_STEP_SHARE = 0.8
# How much the start-up calibration weighs against the window, in window steps: enough to hold the
# prices the window cannot tell apart, little enough that a machine running slower than at
# start-up is followed within a few dozen steps.
PRIOR_WEIGHT = 16.0
# Steps observed between two fits (a fit reads the whole window: ~0.7 ms in Python, too much to
# pay on every few-millisecond step of a GPU; the prices move slowly).
REFIT_EVERY = 4
# Relative ridge towards zero on every coefficient, on features scaled to ~1: keeps the system
# solvable when the data cannot tell two counts apart (it then shares their cost between them).
_RIDGE = 1e-6
# Below this a decode step's fixed part plus a token's price is the ridge's residue, not a measure.
_NO_COST_S = 1e-6


def step_time_target_s(max_step_ms: float, tbt_targets_s: Iterable[float | None]) -> float | None:
    """Seconds a step carrying these decodes should take at most: max_step_ms (0 = none) or
    TBT_STEP_SHARE of the smallest TBT target among them (None = no target), whichever is
    smaller; None when neither applies."""
    targets = [TBT_STEP_SHARE * t for t in tbt_targets_s if t is not None]
    if max_step_ms > 0:
        targets.append(max_step_ms / 1000.0)
    return min(targets, default=None)


def chunk_pairs(num_new: float, num_computed: float) -> float:
    """Attention pairs of a prompt chunk of `num_new` tokens after `num_computed` of its prompt:
    each new token against the context and the new tokens before it."""
    return num_new * num_computed + num_new * (num_new - 1) / 2


@dataclass(frozen=True)
class StepShape:
    """What a step computes, in the counts the cost model prices (module doc). Sums with `+`."""

    dense_passes: float = 0.0  # prompt forwards reading every weight: 1 a step with prompt tokens, a slice its share
    decode_tokens: float = 0.0  # tokens of requests past their prompt (1 + drafts each)
    decode_context: float = 0.0  # the context those rows attend to, summed
    prompt_tokens: float = 0.0  # prompt-chunk tokens
    prompt_pairs: float = 0.0  # their attention pairs (chunk_pairs)
    chunk_context: float = 0.0  # the cached context before each chunk, summed

    # Spelled out, not through dataclasses.fields(): the scheduler sums shapes for every request
    # it prices, every step (fields() made it a tenth of a scheduling step's Python).
    def __add__(self, other: StepShape) -> StepShape:
        return StepShape(
            self.dense_passes + other.dense_passes,
            self.decode_tokens + other.decode_tokens,
            self.decode_context + other.decode_context,
            self.prompt_tokens + other.prompt_tokens,
            self.prompt_pairs + other.prompt_pairs,
            self.chunk_context + other.chunk_context,
        )

    def counts(self) -> tuple[float, ...]:
        return (self.dense_passes, self.decode_tokens, self.decode_context,
                self.prompt_tokens, self.prompt_pairs, self.chunk_context)  # fmt: skip

    @staticmethod
    def decode(num_tokens: int, context: int) -> StepShape:
        """One decoding request verifying `num_tokens` - 1 drafts after `context` tokens."""
        return StepShape(decode_tokens=num_tokens, decode_context=num_tokens * context)

    @staticmethod
    def chunk(num_tokens: float, context: int, share: float = 1.0) -> StepShape:
        """A prompt chunk of `num_tokens` after `context` tokens of its prompt, or `share` of its
        layers (a layer slice). Its dense pass is the step's: one a step, however many chunks;
        `StepPricing` adds it once."""
        return StepShape(
            prompt_tokens=share * num_tokens,
            prompt_pairs=share * chunk_pairs(num_tokens, context),
            chunk_context=share * context if context else 0.0,
        )

    @property
    def num_features(self) -> int:
        return 1 + len(fields(self))

    def features(self) -> tuple[float, ...]:
        return (1.0, *self.counts())


# Feature names, for errors and reports: the fixed part, then StepShape's fields in order.
FEATURES = ("fixed", *(f.name for f in fields(StepShape)))


@dataclass
class StepCostModel:
    window: int = 128  # most recent steps kept
    _steps: deque[tuple[tuple[float, ...], float]] = field(init=False)  # (features, seconds)
    _prior: list[tuple[tuple[float, ...], float]] = field(default_factory=list)  # the calibration's steps
    _coefficients: tuple[float, ...] | None = None
    _num_unfitted: int = 0  # steps observed since the last fit
    _stale: bool = False  # a fit is due: REFIT_EVERY steps since the last, or a new calibration
    _calibrated_fixed: tuple[float, float] | None = None  # the calibration's (fixed, dense pass) seconds

    def __post_init__(self) -> None:
        self._steps = deque(maxlen=self.window)

    def calibrate(self, steps: Sequence[tuple[StepShape, float]]) -> None:
        """The start-up calibration's timed steps: the prior every later fit keeps."""
        self._prior = [(shape.features(), seconds) for shape, seconds in steps if seconds > 0]
        self._stale = True
        prior_fit = _nonnegative_least_squares([(x, y, 1.0) for x, y in self._prior]) if self._prior else None
        self._calibrated_fixed = None if prior_fit is None else (prior_fit[0], prior_fit[1])

    @property
    def calibrated(self) -> bool:
        return bool(self._prior)

    def calibration(self) -> list[tuple[StepShape, float]]:
        """The calibration's timed steps, as `calibrate` took them (a simulated replica's scheduler is
        calibrated with the same prior as the engine it models: servelm.simulate)."""
        return [(StepShape(*features[1:]), seconds) for features, seconds in self._prior]

    @property
    def calibrated_fixed_s(self) -> float | None:
        """The fixed part of a prompt step (fixed + one dense pass) as the calibration alone measured
        it. None without a calibration."""
        return None if self._calibrated_fixed is None else sum(self._calibrated_fixed)

    @property
    def calibrated_parts_s(self) -> tuple[float, float] | None:
        """(what every step pays, what a dense pass over the weights adds) as the calibration alone
        measured them: what the default step-time target derives from, so the target stays put while
        the fit follows the machine. None without a calibration."""
        return self._calibrated_fixed

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One executed step: what it computed and how long the runner took."""
        if seconds > 0 and any(shape.counts()):
            self._steps.append((shape.features(), seconds))
            self._num_unfitted += 1
            if self._num_unfitted >= REFIT_EVERY or self._coefficients is None:
                self._stale = True

    def coefficients(self) -> tuple[float, ...] | None:
        """Seconds per unit of each feature (FEATURES order), all >= 0; None until the steps seen
        tell a fixed part from a per-token price (no calibration and fewer than 4 steps of
        different sizes)."""
        if self._stale:
            self._stale, self._num_unfitted = False, 0
            fitted = self._fit()
            if fitted is not None:
                self._coefficients = fitted
        return self._coefficients

    def predict(self, shape: StepShape) -> float | None:
        """Seconds a step of `shape` should take; None while the model has no fit."""
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        return sum(c * x for c, x in zip(coefficients, shape.features()))

    def fixed_s(self) -> float | None:
        """The fixed part of a step that carries prompt tokens (fixed + one dense pass): what any
        prompt step pays whatever its size. None while there is no fit."""
        coefficients = self.coefficients()
        return None if coefficients is None else coefficients[0] + coefficients[1]

    def decode_cost(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per extra token) of a decode step, the speculation controller's view:
        a one-row decode step is what a step costs whatever drafts it verifies; a draft verified is
        one more row through the matmuls, priced as a prompt token (the decode-token price also
        carries each request's own share of the step: its sampling, its metadata). None while there
        is no fit, or while the fit prices both at nothing: a window of decodes at growing depth can
        put their whole cost on the context they read (a tiny model on a fast host), and a step
        that costs nothing tells the controller nothing (it keeps its prior view instead)."""
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        fixed_s, per_token_s = coefficients[0] + coefficients[2], coefficients[4]
        return (fixed_s, per_token_s) if fixed_s + per_token_s > _NO_COST_S else None

    def prompt_left_s(self, num_tokens: int, context: int) -> float | None:
        """What the `num_tokens` a prompt has left after `context` of its tokens cost to compute:
        their tokens, their attention pairs at that depth and one re-read of the context (no fixed
        part, no dense pass: the steps run anyway). None while the model has no fit."""
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        per_token, per_pair, per_context = coefficients[4], coefficients[5], coefficients[6]
        return per_token * num_tokens + per_pair * chunk_pairs(num_tokens, context) + per_context * context

    def prompt_blocks_s(self, block_size: int, first_depth: int, num_blocks: int) -> list[float] | None:
        """What computing each of `num_blocks` prompt blocks adds to a step, the first starting
        after `first_depth` tokens of its prompt: its tokens and its attention pairs at its depth
        (no fixed part: the step runs anyway). None while the model has no fit."""
        coefficients = self.coefficients()
        if coefficients is None:
            return None
        per_token, per_pair = coefficients[4], coefficients[5]
        return [
            per_token * block_size + per_pair * chunk_pairs(block_size, first_depth + i * block_size)
            for i in range(num_blocks)
        ]

    def _fit(self) -> tuple[float, ...] | None:
        window = list(self._steps)
        if not self._prior:
            sizes = {round(x[3] + x[4]) for x, _ in window}
            if len(window) < 4 or max(sizes, default=0) - min(sizes, default=0) < 8:
                return None  # nothing to tell a fixed part from a per-token price yet
        prior_weight = PRIOR_WEIGHT / max(1, len(self._prior))  # PRIOR_WEIGHT steps' worth in all
        rows = [(x, y, 1.0) for x, y in window] + [(x, y, prior_weight) for x, y in self._prior]
        return _nonnegative_least_squares(rows)


def _nonnegative_least_squares(rows: list[tuple[tuple[float, ...], float, float]]) -> tuple[float, ...] | None:
    """min sum w (y - x.b)^2 / y^2 over b >= 0, by dropping the most negative coefficient and
    solving again until none is left (at most one pass per feature)."""
    num = len(rows[0][0])
    # Scale each feature to ~1 over the data so the ridge and the pivots see comparable columns.
    scale = [max((abs(x[j]) for x, _, _ in rows), default=0.0) or 1.0 for j in range(num)]
    active = [j for j in range(num) if any(x[j] for x, _, _ in rows)]
    while active:
        solution = _solve_weighted(rows, active, scale)
        if solution is None:
            return None
        worst = min(active, key=lambda j: solution[j])
        if solution[worst] >= 0:
            return tuple(solution.get(j, 0.0) / scale[j] for j in range(num))
        active.remove(worst)
    return None


def _solve_weighted(rows: list[tuple[tuple[float, ...], float, float]], active: list[int],
                    scale: list[float]) -> dict[int, float] | None:  # fmt: skip
    """Weighted least squares (weights w / y^2) over the `active` scaled features: their solution."""
    k = len(active)
    a = [[0.0] * k for _ in range(k)]
    b = [0.0] * k
    for x, y, w in rows:
        weight = w / (y * y)
        xs = [x[j] / scale[j] for j in active]
        for i in range(k):
            wx = weight * xs[i]
            b[i] += wx * y
            row = a[i]
            for j in range(i, k):
                row[j] += wx * xs[j]
    for i in range(k):
        for j in range(i):
            a[i][j] = a[j][i]
        a[i][i] += _RIDGE * (a[i][i] or 1.0)
    solved = _gauss(a, b)
    return None if solved is None else dict(zip(active, solved))


def _gauss(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve a x = b (a small dense system) by Gaussian elimination with partial pivoting."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            if factor:
                for c in range(col, n + 1):
                    m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
