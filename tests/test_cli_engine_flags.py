"""Engine flags on the command line reach the config slice that owns them."""

from __future__ import annotations

import pytest

from servelm.cli import build_parser, engine_config_from_args


def test_scheduler_flags_reach_the_scheduler_config() -> None:
    args = build_parser().parse_args(
        ["serve", "--max-step-ms", "250", "--max-num-batched-tokens", "512", "--max-num-seqs", "8"]
    )
    config = engine_config_from_args(args)
    assert config.scheduler.max_step_ms == 250.0
    assert config.scheduler.max_num_batched_tokens == 512 and config.scheduler.max_num_seqs == 8


def test_unset_flags_keep_the_defaults() -> None:
    config = engine_config_from_args(build_parser().parse_args(["serve"]))
    assert config.scheduler.max_step_ms is None  # auto: a target from the calibrated step cost
    assert config.scheduler.layered_prefill


def test_arrival_wait_is_the_step_target_and_zero_is_unbounded() -> None:
    args = build_parser().parse_args(["serve", "--arrival-wait-ms", "0", "--no-layered-prefill"])
    config = engine_config_from_args(args).scheduler
    assert config.max_step_ms == 0.0 and not config.layered_prefill


def test_a_negative_step_target_is_refused() -> None:
    with pytest.raises(ValueError, match="max_step_ms"):
        engine_config_from_args(build_parser().parse_args(["serve", "--max-step-ms", "-1"]))


def test_prefill_scheduling_flags_reach_the_scheduler_config() -> None:
    args = build_parser().parse_args(
        [
            "serve", "--max-num-partial-prefills", "3", "--max-long-partial-prefills", "2",
            "--long-prefill-token-threshold", "256", "--aging-s", "4.5",
        ]
    )  # fmt: skip
    config = engine_config_from_args(args).scheduler
    assert (config.max_num_partial_prefills, config.max_long_partial_prefills) == (3, 2)
    assert config.long_prefill_token_threshold == 256 and config.prefill_chunk_cap == 256
    assert config.aging_s == 4.5


def test_unset_prefill_flags_derive_the_chunk_cap_from_the_budget() -> None:
    config = engine_config_from_args(build_parser().parse_args(["serve", "--max-num-batched-tokens", "1024"]))
    assert config.scheduler.long_prefill_token_threshold is None
    assert config.scheduler.prefill_chunk_cap == 1024 // config.scheduler.max_num_partial_prefills


def test_no_shm_collectives_sends_every_collective_over_gloo() -> None:
    assert engine_config_from_args(build_parser().parse_args(["serve"])).parallel.shared_memory_collectives
    args = build_parser().parse_args(["serve", "-tp", "2", "--no-shm-collectives"])
    assert not engine_config_from_args(args).parallel.shared_memory_collectives


def test_delivery_and_kv_event_flags_reach_their_config() -> None:
    args = build_parser().parse_args(
        ["serve", "--model", "peer://10.0.0.7:8000", "--download-dir", "/data/models", "--pull-connections", "4",
         "--kv-events-port", "5557", "--kv-events-host", "0.0.0.0"]
    )  # fmt: skip
    config = engine_config_from_args(args)
    assert config.model.model == "peer://10.0.0.7:8000"
    assert (config.model.download_dir, config.model.pull_connections) == ("/data/models", 4)
    assert (config.kv_events.kv_events_port, config.kv_events.kv_events_host) == (5557, "0.0.0.0")


def test_attention_backend_flag_reaches_the_model_config() -> None:
    assert engine_config_from_args(build_parser().parse_args(["serve"])).model.attention_backend == "auto"
    args = build_parser().parse_args(["serve", "--attention-backend", "triton"])
    assert engine_config_from_args(args).model.attention_backend == "triton"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--attention-backend", "flash"])


def test_gemm_precision_flag_reaches_the_model_config() -> None:
    assert engine_config_from_args(build_parser().parse_args(["serve"])).model.gemm_precision == "float32"
    args = build_parser().parse_args(["serve", "--gemm-precision", "bfloat16"])
    assert engine_config_from_args(args).model.gemm_precision == "bfloat16"
    with pytest.raises(SystemExit):  # argparse refuses what the engine does not offer
        build_parser().parse_args(["serve", "--gemm-precision", "int8"])


def test_the_kv_load_policy_flag_reaches_the_tier_config() -> None:
    assert engine_config_from_args(build_parser().parse_args(["serve"])).kv_tiers.kv_load_policy == "cost"
    args = build_parser().parse_args(["serve", "--kv-offloading-size", "1", "--kv-load-policy", "always"])
    assert engine_config_from_args(args).kv_tiers.kv_load_policy == "always"


def test_each_flag_is_declared_once_in_the_slice_it_sets() -> None:
    from dataclasses import fields

    from servelm.config import _GIB_SETTINGS, FLAG_SLICES, KVTierConfig, SpeculativeConfig

    conveniences = {name: KVTierConfig for name in ("kv_offloading_size", "kv_disk_size", "kv_disk_path")}
    conveniences |= {"kv_cache_memory_gib": FLAG_SLICES[1][1], "speculative_config": SpeculativeConfig}
    assert set(_GIB_SETTINGS) <= set(conveniences)
    names: list[str] = []
    for _, config_slice in FLAG_SLICES:
        for flag in config_slice.FLAGS:
            names.extend(flag.names)
            owner = conveniences.get(flag.setting)
            assert owner is config_slice or flag.setting in {f.name for f in fields(config_slice)}, flag
    assert len(names) == len(set(names)), "a flag declared twice"
    parser = build_parser()
    for command in ("serve", "generate"):  # every engine command takes every engine flag
        args = parser.parse_args([command, "--kv-events-port", "5557", "--no-prefix-caching"])
        config = engine_config_from_args(args)
        assert config.kv_events.kv_events_port == 5557 and not config.cache.enable_prefix_caching


def test_flag_arguments_give_back_the_settings_they_were_made_from() -> None:
    """config.flag_arguments is cli's reading of the flags run backwards: `servelm simulate
    calibrate` starts a real server with the settings it built its engine from."""
    from servelm.cli import engine_settings
    from servelm.config import flag_arguments

    given = ["serve", "--max-step-ms", "250", "--max-num-seqs", "8", "--no-prefix-caching", "--no-layered-prefill",
             "--num-blocks", "96", "--enforce-eager"]  # fmt: skip
    settings = engine_settings(build_parser().parse_args(given))
    again = engine_settings(build_parser().parse_args(["serve", *flag_arguments(settings)]))
    assert again == settings and settings["max_step_ms"] == 250.0 and settings["enable_prefix_caching"] is False
