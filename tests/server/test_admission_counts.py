"""What admission counts as waiting (admission.py), from the counts it is handed: the core's queued
requests, what exceeds the sequence slots, and what is being tokenized."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from servelm.server.admission import Admission
from servelm.server.errors import APIError


@dataclass
class Counts:
    tokenizing: int = 0
    in_flight: int = 0
    core_queued: int = 0


def admission(counts: Counts, max_waiting: int = 4, max_num_seqs: int = 64) -> Admission:
    return Admission(
        max_waiting=max_waiting,
        max_num_seqs=max_num_seqs,
        num_tokenizing=lambda: counts.tokenizing,
        num_engine_in_flight=lambda: counts.in_flight,
        num_core_queued=lambda: counts.core_queued,
        engine_down=lambda: None,
    )


def status_of(gate: Admission, num_engine_requests: int = 1) -> int:
    try:
        gate.admit(num_engine_requests)
    except APIError as error:
        return error.status
    return 200


def test_a_burst_within_free_seats_is_admitted_until_the_core_reports_a_queue() -> None:
    counts = Counts(in_flight=39)  # 39 sent, none queued long enough to count
    gate = admission(counts)
    assert status_of(gate) == 200
    counts.core_queued = 4  # four of them have now waited QUEUED_AFTER_S: the queue is full
    assert status_of(gate) == 429


@pytest.mark.parametrize("counts, expected", [
    (Counts(in_flight=67), 200),  # 3 beyond the 64 seats wait for sure, and this one: 4
    (Counts(in_flight=68), 429),
    (Counts(in_flight=10, core_queued=3), 200),
    (Counts(in_flight=2, core_queued=9), 200),  # stale stats: never more queued than in flight
    (Counts(tokenizing=2, in_flight=66), 429),  # being tokenized waits too
])  # fmt: skip
def test_waiting_is_the_larger_of_the_core_queue_and_the_excess_over_seats(counts: Counts, expected: int) -> None:
    assert status_of(admission(counts)) == expected


def test_a_request_larger_than_the_queue_is_a_400_and_a_draining_server_503() -> None:
    gate = admission(Counts())
    assert status_of(gate, num_engine_requests=5) == 400
    gate.draining = True
    assert status_of(gate) == 503
