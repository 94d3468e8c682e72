"""Config slices: every value has one owner, and a rule between two values is checked once both are known."""

from __future__ import annotations

import pytest

from servelm import LLM, SamplingParams
from servelm.config import EngineConfig, SchedulerConfig
from servelm.testing.tiny_model import write_tiny_checkpoint


def test_unchunked_budget_covering_the_requested_window_is_accepted() -> None:
    config = EngineConfig.from_flat(max_model_len=2048, enable_chunked_prefill=False, max_num_batched_tokens=4096)
    assert config.model.max_model_len == 2048  # ModelConfig owns the wish
    assert config.scheduler.max_model_len is None  # the scheduler gets only the resolved window
    assert config.scheduler_for(2048).max_model_len == 2048


def test_unchunked_budget_below_the_resolved_window_is_refused_naming_both_settings() -> None:
    config = EngineConfig.from_flat(enable_chunked_prefill=False, max_num_batched_tokens=4096)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4096\).*max_model_len \(8192\)"):
        config.scheduler_for(8192)


def test_the_scheduler_window_is_not_a_user_setting() -> None:
    # max_model_len reaches ModelConfig only; the scheduler's copy is the builder's to fill.
    config = EngineConfig.from_flat(max_model_len=512)
    assert (config.model.max_model_len, config.scheduler.max_model_len) == (512, None)


def test_an_unresolved_scheduler_slice_is_refused_by_the_scheduler() -> None:
    from servelm.kv.kv_cache_manager import KVCacheManager
    from servelm.scheduler.scheduler import Scheduler

    with pytest.raises(ValueError, match="max_model_len is unresolved"):
        Scheduler(SchedulerConfig(), KVCacheManager(8, 16))


def test_kv_events_have_one_switch() -> None:
    assert not EngineConfig().kv_events.enabled
    assert EngineConfig.from_flat(kv_events_port=9100).kv_events.enabled
    with pytest.raises(ValueError, match="unknown engine setting 'enable_kv_events'"):
        EngineConfig.from_flat(enable_kv_events=True)


def test_the_builder_checks_the_unchunked_budget_against_the_window_it_resolved(tmp_path) -> None:
    model_dir = str(write_tiny_checkpoint(tmp_path / "model", seed=3))  # max_position_embeddings 1024
    # Asked for more than the model has: resolved to 1024, which the budget covers.
    llm = LLM(model_dir, num_blocks=128, max_model_len=4096, enable_chunked_prefill=False, max_num_batched_tokens=1024)
    assert llm.engine.max_model_len == 1024
    [result] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(result.outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(512\).*max_model_len \(1024\)"):
        LLM(model_dir, num_blocks=128, enable_chunked_prefill=False, max_num_batched_tokens=512)
