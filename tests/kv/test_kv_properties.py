"""Random interleavings of allocate / grow / free / abort / preempt keep every block accounted for."""

from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from servelm.kv import KVCacheManager

BLOCK_SIZE = 4
NUM_BLOCKS = 12
# A tiny alphabet and a few shared prefixes make hits, duplicates and evictions common.
PREFIXES = [[1] * 12, [1] * 4 + [2] * 8, [3, 1, 2, 3, 1, 2, 3, 1]]


@dataclass
class Model:
    tokens: list[int]
    num_computed: int = 0
    salt: bytes | None = None
    preempted_outputs: list[int] = field(default_factory=list)


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.running: dict[str, Model] = {}
        self.preempted: dict[str, Model] = {}
        self.next_id = 0

    @initialize(prefix_caching=st.booleans())
    def setup(self, prefix_caching: bool) -> None:
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=prefix_caching)

    def _admit(self, request_id: str, model: Model, chunk: int) -> bool:
        hit = self.kv.get_computed_blocks(request_id, model.tokens, model.salt)
        assert hit.num_computed_tokens < len(model.tokens)
        num_new = min(len(model.tokens) - hit.num_computed_tokens, chunk)
        new_ids = self.kv.allocate_slots(
            request_id, num_new, num_computed_tokens=hit.num_computed_tokens, computed_blocks=hit
        )
        if new_ids is None:
            assert self.kv.get_block_ids(request_id) == []
            return False
        model.num_computed = hit.num_computed_tokens + num_new
        self.kv.cache_full_blocks(request_id, model.tokens, model.num_computed)
        self.running[request_id] = model
        return True

    @rule(
        prefix=st.sampled_from(PREFIXES),
        cut=st.integers(0, 12),
        suffix=st.lists(st.integers(1, 3), max_size=6),
        salted=st.booleans(),
        chunk=st.integers(1, 16),
    )
    def add(self, prefix: list[int], cut: int, suffix: list[int], salted: bool, chunk: int) -> None:
        tokens = prefix[:cut] + suffix
        if not tokens:
            return
        self.next_id += 1
        self._admit(f"r{self.next_id}", Model(tokens, salt=b"s" if salted else None), chunk)

    @precondition(lambda self: self.preempted)
    @rule(data=st.data(), chunk=st.integers(1, 16))
    def resume(self, data: st.DataObject, chunk: int) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.preempted)))
        if self._admit(request_id, self.preempted[request_id], chunk):
            del self.preempted[request_id]

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 8), sampled=st.integers(1, 3))
    def grow(self, data: st.DataObject, chunk: int, sampled: int) -> None:
        """One step: the next prefill chunk, or a decode after appending a sampled token."""
        request_id = data.draw(st.sampled_from(sorted(self.running)))
        model = self.running[request_id]
        if model.num_computed == len(model.tokens):
            model.tokens.append(sampled)
        num_new = min(chunk, len(model.tokens) - model.num_computed)
        held = self.kv.get_block_ids(request_id)
        new_ids = self.kv.allocate_slots(request_id, num_new, num_computed_tokens=model.num_computed)
        if new_ids is None:  # out of blocks: preempt it, as the scheduler would
            assert self.kv.get_block_ids(request_id) == held
            self._preempt(request_id)
            return
        assert self.kv.get_block_ids(request_id) == held + new_ids
        model.num_computed += num_new
        self.kv.cache_full_blocks(request_id, model.tokens, model.num_computed)

    def _preempt(self, request_id: str) -> None:
        self.kv.free(request_id)
        model = self.running.pop(request_id)
        model.num_computed = 0
        self.preempted[request_id] = model

    @precondition(lambda self: self.running)
    @rule(data=st.data(), how=st.sampled_from(["finish", "abort", "preempt"]))
    def release(self, data: st.DataObject, how: str) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.running)))
        if how == "preempt":
            self._preempt(request_id)
        else:
            self.kv.free(request_id)
            del self.running[request_id]

    @invariant()
    def consistent(self) -> None:
        self.kv.check_invariants()
        held = set()
        for request_id, model in self.running.items():
            block_ids = self.kv.get_block_ids(request_id)
            assert len(block_ids) == -(-model.num_computed // BLOCK_SIZE)
            held.update(block_ids)
        for request_id in self.preempted:
            assert self.kv.get_block_ids(request_id) == []
        assert self.kv.num_free_blocks == NUM_BLOCKS - len(held)

    def teardown(self) -> None:
        for request_id in list(self.running):
            self.kv.free(request_id)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == NUM_BLOCKS and self.kv.usage == 0.0
        assert all(block.ref_count == 0 for block in self.kv.pool.blocks)
        assert sorted(b.block_id for b in self.kv.pool.free_queue) == list(range(NUM_BLOCKS))


KVMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestKVMachine = KVMachine.TestCase
