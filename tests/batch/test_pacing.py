"""The batch pacer's rule (pacing.py) on the loads it reads: halve when something waits beside
interactive requests, one fewer when only batch lines wait, one more when the batch fills its room."""

from __future__ import annotations

from servelm.batch.pacing import BatchPacer, EngineLoad


def test_pacing_follows_the_engines_queue():
    load, ceiling = EngineLoad(num_waiting=0, num_in_flight=0), 8
    pacer = BatchPacer(lambda: load, ceiling=lambda: ceiling, start=2)
    load = EngineLoad(0, 2)
    assert [pacer.tick(batch_in_flight=pacer.limit) for _ in range(8)] == [3, 4, 5, 6, 7, 8, 8, 8]  # up to the ceiling
    assert pacer.tick(batch_in_flight=3) == 8  # room left unused: no growth, no cut
    load = EngineLoad(num_waiting=2, num_in_flight=8)  # only batch lines in flight, some waiting
    assert pacer.tick(batch_in_flight=8) == 7
    load = EngineLoad(num_waiting=1, num_in_flight=12)  # 5 interactive requests in flight, something waits
    assert [pacer.tick(batch_in_flight=7) for _ in range(4)] == [3, 1, 1, 1]
    load, ceiling = EngineLoad(0, 1), 0  # a router with no replica in rotation: one line at most
    assert pacer.tick(batch_in_flight=1) == 1
