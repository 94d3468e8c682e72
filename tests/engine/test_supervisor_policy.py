"""The supervisor's arithmetic and the config a replacement core gets (the restarts themselves run
against real processes in tests/server/test_engine_supervision.py)."""

from __future__ import annotations

import pytest

from servelm.config import EngineConfig
from servelm.engine.async_client import CoreExit, lost_with_core
from servelm.engine.messages import CoreReady
from servelm.engine.supervisor import CrashWindow, RestartPolicy, restart_config


def test_backoff_doubles_from_the_first_wait_up_to_the_cap():
    policy = RestartPolicy(max_restarts=8, first_backoff_s=1.0, max_backoff_s=10.0)
    assert [policy.backoff_s(attempt) for attempt in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


@pytest.mark.parametrize("settings", [{"max_restarts": -1}, {"window_s": 0}, {"first_backoff_s": 40.0}])
def test_a_policy_that_cannot_work_is_refused(settings):
    with pytest.raises(ValueError):
        RestartPolicy(**settings)


def test_crashes_older_than_the_window_no_longer_count():
    window = CrashWindow(window_s=15.0)
    assert [window.record(t) for t in (0.0, 10.0, 15.0, 20.0, 40.0)] == [1, 2, 3, 3, 1]
    window.record(45.0)
    assert window.span_s() == 5.0


def _ready(source: str, kv_transfer_address: str | None = None) -> CoreReady:
    return CoreReady(max_model_len=64, num_blocks=8, block_size=16, vocab_size=100, source=source,
                     kv_transfer_address=kv_transfer_address)  # fmt: skip


def test_a_remote_model_restarts_from_its_download_directory_not_a_second_pull():
    config = EngineConfig.from_flat(model="https://models.example/tiny/", download_dir="/data/models")
    pinned = restart_config(config, _ready("/data/models/tiny-abc"))
    assert pinned.model.model == "/data/models/tiny-abc" and pinned.model.download_dir == "/data/models"
    assert pinned.cache == config.cache and pinned.scheduler == config.scheduler


def test_a_producer_restarts_on_the_transfer_port_its_consumers_know():
    config = EngineConfig.from_flat(model="/m", kv_role="prefill")
    pinned = restart_config(config, _ready("/m", "tcp://127.0.0.1:41234"))
    assert pinned.kv_transfer.kv_transfer_port == 41234 and pinned.model.model == "/m"
    local = EngineConfig.from_flat(model="/m")
    assert restart_config(local, _ready("/m")) == local


def test_an_exit_names_the_signal_and_the_traceback():
    assert CoreExit(-9).describe() == "killed by SIGKILL"
    assert CoreExit(1, "Traceback ...\nRuntimeError: boom").describe() == (
        "exit code 1, after it failed:\nTraceback ...\nRuntimeError: boom"
    )
    assert not lost_with_core("prompt too long") and not lost_with_core(None)
