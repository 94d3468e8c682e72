"""Trace replay: requests from a JSONL file in the format of the public Mooncake traces.

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

`timestamp` is in milliseconds (Mooncake's unit; `time_unit_s` changes it). Each hash id
names one block of `block_size` prompt tokens (512 in Mooncake); equal ids are the same
tokens, so two requests whose hash_ids start alike share that prefix token for token. We
turn every hash id into its own seeded block of clean-word ids; the prompt is the blocks in
order, cut to `input_length` (the last block is usually partial) or padded with tokens of
its own when the trace gives fewer blocks than the length needs.

Send time = (timestamp - first timestamp) x time_unit_s x time_scale: time_scale 0.5 replays
the trace twice as fast.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from servelm.bench.tokens import TokenSource
from servelm.bench.workload import DEFAULT_PRIORITIES, LengthLimits, WorkloadRequest

MOONCAKE_BLOCK_SIZE = 512


@dataclass(frozen=True)
class TraceEntry:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()


def load_trace(path: str | Path, max_entries: int | None = None) -> list[TraceEntry]:
    """Entries in file order (which must be timestamp order); blank lines are skipped."""
    entries: list[TraceEntry] = []
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                entry = TraceEntry(float(raw["timestamp"]), int(raw["input_length"]), int(raw["output_length"]),
                                   tuple(int(h) for h in raw.get("hash_ids") or ()))  # fmt: skip
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a trace entry ({exc!r}): {line.strip()[:200]}") from exc
            if entries and entry.timestamp < entries[-1].timestamp:
                raise ValueError(f"{path}:{number}: timestamp {entry.timestamp} goes back in time")
            if entry.input_length < 1 or entry.output_length < 1:
                raise ValueError(f"{path}:{number}: input_length and output_length must be >= 1")
            entries.append(entry)
            if max_entries is not None and len(entries) >= max_entries:
                break
    if not entries:
        raise ValueError(f"{path}: no trace entries")
    return entries


@dataclass
class TraceReplay:
    tokens: TokenSource
    limits: LengthLimits
    seed: int = 0
    block_size: int = MOONCAKE_BLOCK_SIZE  # tokens per hash id, before limits.prompt_scale
    time_scale: float = 1.0
    time_unit_s: float = 0.001
    salt: int = 0  # other tokens, same lengths and sharing (see profiles.build_workload)

    def __post_init__(self) -> None:
        if self.time_scale <= 0 or self.time_unit_s <= 0:
            raise ValueError("time_scale and time_unit_s must be > 0")
        self._blocks: dict[int, list[int]] = {}
        self._block_tokens = self.limits.prompt(self.block_size)

    def _block(self, hash_id: int) -> list[int]:
        if hash_id not in self._blocks:
            self._blocks[hash_id] = self.tokens.sample(
                random.Random(f"{self.seed}:block:{hash_id}:{self.salt}"), self._block_tokens
            )
        return self._blocks[hash_id]

    def workload(self, entries: list[TraceEntry]) -> list[WorkloadRequest]:
        start = entries[0].timestamp
        seen: set[int] = set()
        requests = []
        for index, entry in enumerate(entries):
            max_tokens = min(self.limits.output(entry.output_length), self.limits.max_context // 2)
            budget = self.limits.max_context - self.tokens.num_special_tokens - max_tokens
            length = min(self.limits.prompt(entry.input_length), budget)
            prompt_ids = [t for h in entry.hash_ids for t in self._block(h)][:length]
            if len(prompt_ids) < length:
                rng = random.Random(f"{self.seed}:request:{index}:{self.salt}")
                prompt_ids += self.tokens.sample(rng, length - len(prompt_ids))
            shared_blocks = next((i for i, h in enumerate(entry.hash_ids) if h not in seen), len(entry.hash_ids))
            seen.update(entry.hash_ids)
            requests.append(WorkloadRequest(
                index=index,
                traffic_class="trace",
                prompt_ids=prompt_ids,
                num_prompt_tokens=len(prompt_ids) + self.tokens.num_special_tokens,
                max_tokens=max_tokens,
                priority=DEFAULT_PRIORITIES["trace"],
                shared_prefix_tokens=min(shared_blocks * self._block_tokens, len(prompt_ids)),
                arrival_s=(entry.timestamp - start) * self.time_unit_s * self.time_scale,
                prompt_text=self.tokens.exact_text(prompt_ids),
            ))  # fmt: skip
        return requests
