"""`servelm simulate`: a simulated replica schedules as the real engine does; the fleet's times are
its cost profile's arithmetic; routing is the router's policies; the commands write bench's reports.

The real engine here is the tiny random model (tests/conftest.py's checkpoint), in process."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from servelm.bench.workload import WorkloadRequest
from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest
from servelm.engine.builder import build_engine
from servelm.sampling_params import SamplingParams
from servelm.scheduler.step_cost import FEATURES, StepShape
from servelm.simulate.fleet import Fleet, FleetConfig, prompt_token_ids
from servelm.simulate.profile import CALIBRATED, CostProfile, EngineShape
from servelm.simulate.replica import SimReplica

FIXED, PER_PASS, PER_DECODE, PER_TOKEN = 0.010, 0.004, 0.002, 0.001


def arithmetic_profile(num_blocks: int = 256, step_overhead_s: float = 0.003, request_overhead_s: float = 0.005,
                       **engine_flags: object) -> CostProfile:  # fmt: skip
    """A profile whose costs are round numbers: a step costs fixed + a pass (prompt steps) + per
    decode row + per prompt token; its calibration is steps of exactly those costs."""
    coefficients = dict.fromkeys(FEATURES, 0.0) | {"fixed": FIXED, "dense_passes": PER_PASS,
                                                   "decode_tokens": PER_DECODE, "prompt_tokens": PER_TOKEN}  # fmt: skip
    values = tuple(coefficients[name] for name in FEATURES)
    shapes = [StepShape(dense_passes=1.0) + StepShape.chunk(n, 0) for n in (16, 64, 256)]
    shapes += [StepShape.decode(1, 64) + StepShape.decode(1, 64) for _ in range(4)] + [StepShape.decode(1, 16)]
    calibration = tuple((shape, sum(c * x for c, x in zip(values, shape.features()))) for shape in shapes)
    engine = EngineShape("tiny", num_blocks, 16, 1024, 0, dict(engine_flags))
    return CostProfile("test host", CALIBRATED, "2026-12-07", values, step_overhead_s, 0.0, request_overhead_s,
                       calibration, engine)  # fmt: skip


def workload(prompts: list[list[int]], max_tokens: int, arrivals: list[float]) -> list[WorkloadRequest]:
    return [WorkloadRequest(index=i, traffic_class="voice", prompt_ids=p, num_prompt_tokens=len(p) + 1,
                            max_tokens=max_tokens, arrival_s=a) for i, (p, a) in enumerate(zip(prompts, arrivals))]  # fmt: skip


def test_a_simulated_replica_schedules_every_step_as_the_real_engine_does(tiny_dir):
    """Same requests at the same steps: the simulated replica's scheduler (the real one, with no
    forward) admits, chunks, hits the prefix cache and preempts exactly as the engine running the
    model. Time-independent settings (no step-time target, no aging), since the two clocks differ."""
    flags = {"num_blocks": 12, "block_size": 16, "max_num_batched_tokens": 48, "max_num_seqs": 5, "max_step_ms": 0,
             "aging_s": 0}  # fmt: skip
    built = build_engine(EngineConfig.from_flat(str(tiny_dir), **flags))
    real = built.core.scheduler
    shape = EngineShape(str(tiny_dir), built.num_blocks, 16, built.max_model_len, real.layered_prefill_layers, flags)
    profile = CostProfile(**{**arithmetic_profile().__dict__, "engine": shape})
    now = [0.0]
    simulated = SimReplica(profile, lambda: now[0])
    rng = random.Random(3)
    shared = [rng.randrange(100, 1000) for _ in range(40)]
    prompts = [(shared if i % 3 == 0 else []) + [rng.randrange(100, 1000) for _ in range(rng.randint(5, 60))]
               for i in range(12)]  # fmt: skip
    arrivals = [rng.randint(0, 12) for _ in prompts]

    def request(i: int) -> EngineRequest:
        params = SamplingParams(temperature=0.0, max_tokens=rng_tokens[i], ignore_eos=True)
        return EngineRequest(request_id=str(i), prompt_token_ids=prompts[i], sampling_params=params)

    rng_tokens = [rng.randint(20, 60) for _ in prompts]
    real_steps, simulated_steps = [], []
    for step in range(400):
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                built.core.add_request(request(i))
                simulated.add(request(i))
        if not built.core.has_work() and step > max(arrivals):
            break
        output = real.schedule()
        real.update(output, built.core.runner.execute(output))
        real_steps.append((output.num_scheduled_tokens, sorted(output.preempted_request_ids)))
        planned = simulated.plan_step()
        simulated.finish_step()
        simulated_steps.append((planned.output.num_scheduled_tokens, sorted(planned.output.preempted_request_ids)))
    assert not built.core.has_work() and not simulated.has_work()
    assert simulated_steps == real_steps
    assert any(preempted for _, preempted in real_steps), "the pool was meant to be short enough to preempt"
    assert simulated.kv.stats.num_hit_tokens == built.core.kv_manager.stats.num_hit_tokens > 0
    built.core.close()


def test_a_lone_request_waits_what_its_profile_says():
    """TTFT = the way in + its prefill step; every later token one decode step after the last."""
    requests = workload([list(range(100, 130))], max_tokens=5, arrivals=[1.0])
    profile = arithmetic_profile()
    result = Fleet(profile, FleetConfig()).run(requests)
    record = result.records[0]
    prefill = FIXED + PER_PASS + 31 * PER_TOKEN + profile.step_overhead_s  # 30 tokens and the BOS stand-in
    decode = FIXED + PER_DECODE + profile.step_overhead_s
    assert record.status == "ok" and record.sent_s == 1.0 and record.num_output_tokens == 5
    assert record.ttft_s == pytest.approx(profile.request_overhead_s + prefill)
    assert record.itl_s == pytest.approx([decode] * 4)
    assert result.duration_s == pytest.approx(1.0 + profile.request_overhead_s + prefill + 4 * decode)
    assert result.utilization()[0] == pytest.approx((prefill + 4 * decode) / result.duration_s)


def test_a_sessions_next_turn_waits_for_the_turn_before_it():
    first, second = workload([list(range(100, 120)), list(range(100, 140))], max_tokens=3, arrivals=[0.0, 0.0])
    first.session_id = second.session_id = "s"
    second.after = 0
    result = Fleet(arithmetic_profile(), FleetConfig()).run([first, second])
    assert result.records[1].sent_s == pytest.approx(result.records[0].end_s)
    assert result.records[1].num_cached_tokens >= 16  # the turn before it left its prompt in the cache


def test_routing_goes_through_the_routers_policies():
    """Round robin alternates; `kv` sends a prompt to the replica whose KV events said it holds the
    prefix: more of the prompts are served from cache (3 prefixes over 2 replicas)."""
    rng = random.Random(5)
    prefixes = [[rng.randrange(100, 1000) for _ in range(96)] for _ in range(3)]
    prompts = [prefixes[i % 3] + [rng.randrange(100, 1000) for _ in range(8)] for i in range(12)]
    requests = workload(prompts, max_tokens=2, arrivals=[0.5 * i for i in range(12)])  # one at a time
    hit_rates = {}
    for policy in ("round_robin", "kv"):
        fleet = Fleet(arithmetic_profile(), FleetConfig(num_replicas=2, policy=policy))
        result = fleet.run(requests)
        assert all(r.status == "ok" for r in result.records)
        hit_rates[policy] = result.prefix_hit_rate
        if policy == "round_robin":
            assert [r.num_requests for r in fleet.routes] == [6, 6]
    # kv: each prefix's first request misses, the other three hit its 6 blocks (96 of 105 tokens).
    assert hit_rates["kv"] == pytest.approx(9 * 96 / (12 * 105))
    assert hit_rates["kv"] > hit_rates["round_robin"]


def test_the_time_limit_cuts_what_is_still_running():
    requests = workload([list(range(100, 110))], max_tokens=500, arrivals=[0.0])
    result = Fleet(arithmetic_profile(), FleetConfig(duration_s=0.5)).run(requests)
    assert result.records[0].status == "cancelled" and result.duration_s == 0.5


def test_prompts_get_stand_ins_for_the_positions_tokenization_adds():
    request = workload([[7, 8, 9]], max_tokens=1, arrivals=[0.0])[0]
    assert prompt_token_ids(request) == [0, 7, 8, 9]
    request.num_prompt_tokens = 7  # a chat template's markers too
    assert prompt_token_ids(request) == [0, 7, 8, 9, 0, 0, 0]


def test_a_profile_round_trips_and_a_wrong_file_is_refused(tmp_path):
    profile = arithmetic_profile(max_num_seqs=8)
    assert CostProfile.load(profile.save(tmp_path / "p.json")) == profile
    assert "simulated (calibrated on test host, tiny)" == profile.label
    (tmp_path / "bad.json").write_text(json.dumps({"schema": "something else"}))
    with pytest.raises(ValueError, match="not a cost profile"):
        CostProfile.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="never negative"):
        CostProfile(**{**profile.__dict__, "step_overhead_s": -1.0})


def _servelm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "servelm.cli", *args], capture_output=True, text=True, timeout=300)


def test_calibrate_then_run_write_a_profile_and_benchs_reports(tiny_dir, tmp_path):
    """The commands end to end on the tiny model: the calibration traces a real server's steps
    under its plan, the run replays a voice workload and reports it as bench does."""
    profile_path = tmp_path / "tiny.json"
    done = _servelm("simulate", "calibrate", "--model", str(tiny_dir), "--quick", "--num-threads", "1",
                    "--num-blocks", "512", "--out", str(profile_path))  # fmt: skip
    assert done.returncode == 0, done.stderr
    profile = CostProfile.load(profile_path)
    assert profile.kind == CALIBRATED and profile.engine.num_blocks == 512 and profile.calibration
    assert profile.engine.engine_flags == {"num_threads": 1, "num_blocks": 512}
    # The fit prices what a step computes (its intercept alone may fit to 0: the fit is non-negative
    # least squares over the traced steps, and a loaded machine's steps once put it all elsewhere).
    assert all(c >= 0 for c in profile.coefficients) and "steps of a traced server" in profile.notes
    assert profile.forward_s(StepShape(dense_passes=1) + StepShape.chunk(16, 0)) > 0
    assert profile.forward_s(StepShape.decode(1, 16)) > 0
    assert profile.engine.max_model_len > 0 and len(profile.calibration) >= 5  # the server's own start-up calibration
    out = tmp_path / "run"
    done = _servelm("simulate", "run", "--cost-profile", str(profile_path), "--profile", "voice", "--rate", "4",
                    "--num-requests", "40", "--out", str(out), "--no-plots",
                    "--price-per-device-hour", "2.5")  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "run.json").read_text())
    assert report["schema"] == "servelm-bench/1" and report["server"]["simulated"] is True
    assert len(report["requests"]) == 40 and all(r["status"] == "ok" for r in report["requests"])
    summary = report["summary"]["overall"]
    assert summary["ttft_s"]["p50"] > 0 and summary["tbt_s"]["p50"] > 0
    assert report["server"]["cost_per_million_output_tokens"] > 0
    assert (out / "summary.md").read_text().startswith("> **simulated (calibrated on")
    missing = _servelm("simulate", "run", "--cost-profile", str(tmp_path / "none.json"), "--out", str(out))
    assert missing.returncode == 2 and "cannot read a cost profile" in missing.stderr


LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}  # fmt: skip


def test_a_roofline_profile_is_the_devices_arithmetic_and_says_it_is_an_estimate(tmp_path):
    from servelm.simulate.roofline import BANDWIDTH_EFFICIENCY, DEVICES, STEP_LAUNCH_S, roofline_profile

    profile = roofline_profile("H200", LLAMA_8B, "llama-8b")
    assert profile.label == "simulated (roofline estimate for NVIDIA H200 SXM, llama-8b)" and "not measured" in profile.notes
    h200 = DEVICES["h200"]
    weights = 2 * 8.03e9  # bf16 bytes of Llama-3-8B's 8.03B parameters
    decode = profile.forward_s(StepShape.decode(1, 0))
    assert decode == pytest.approx(weights / (h200.bandwidth * BANDWIDTH_EFFICIENCY) + STEP_LAUNCH_S, rel=0.02)
    kv_per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16
    assert profile.engine.num_blocks * 16 * kv_per_token == pytest.approx(0.9 * (141e9 - weights), rel=0.01)
    assert profile.engine.max_model_len == 32768
    assert roofline_profile("h100", LLAMA_8B).forward_s(StepShape.decode(1, 0)) > decode  # less bandwidth
    requests = workload([list(range(100, 400))] * 4, max_tokens=16, arrivals=[0.0, 0.01, 0.02, 0.03])
    result = Fleet(profile, FleetConfig(num_replicas=2, policy="kv")).run(requests)
    assert all(r.status == "ok" for r in result.records)
    assert max(r.ttft_s for r in result.records) < 0.1  # a 300-token prompt on an H200: milliseconds
    with pytest.raises(ValueError, match="unknown device"):
        roofline_profile("tpu", LLAMA_8B)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    done = _servelm("simulate", "roofline", "--device", "h100", "--model-config", str(tmp_path), "--out",
                    str(tmp_path / "h100.json"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert CostProfile.load(tmp_path / "h100.json").kind == "roofline"


def test_with_a_tenants_file_requests_run_in_their_tenants_classes(tmp_path):
    """As the server would: voice's key names a realtime tenant, analytics' a batch tenant (priority
    1, never aged past voice); a class whose key no tenant has is refused before anything runs."""
    from servelm.tenancy.config import load_tenants
    from servelm.tenancy.registry import TenantRegistry

    (tmp_path / "tenants.yaml").write_text("tenants:\n  bot: {api_keys: [kv], class: realtime}\n"
                                           "  docs: {api_keys: [ka], class: batch}\n")  # fmt: skip
    registry = TenantRegistry.build(load_tenants(tmp_path / "tenants.yaml"), None)
    voice, document = workload([list(range(100, 140)), list(range(200, 900))], max_tokens=4, arrivals=[0.0, 0.0])
    document.traffic_class = "analytics"
    config = FleetConfig(tenants=registry, class_keys={"voice": "kv", "analytics": "ka"})
    fleet = Fleet(arithmetic_profile(), config)
    voice_request, document_request = fleet._engine_request(voice), fleet._engine_request(document)
    assert (voice_request.priority, voice_request.slo.slo_class, voice_request.slo.ttft_target_s) == (0, "realtime", 0.3)
    assert (document_request.priority, document_request.slo.slo_class, document_request.slo.ages) == (1, "batch", False)
    assert all(r.status == "ok" for r in fleet.run([voice, document]).records)
    unknown = Fleet(arithmetic_profile(), FleetConfig(tenants=registry, class_keys={"voice": "nope"}))
    with pytest.raises(ValueError, match="no tenant has the API key the 'voice' requests send"):
        unknown.run([voice])
