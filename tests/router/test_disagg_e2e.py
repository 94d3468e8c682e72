"""Prefill/decode disaggregation through the router, end to end with real processes: a prefill
worker and a decode worker (`servelm cluster` pools, tiny model) behind `servelm router`, and a
plain replica of the same model as the reference. Greedy output through the split must equal
the plain replica's; short prompts stay whole; the router's metrics count every decision."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from servelm.cli import build_parser
from servelm.cluster.local import LocalCluster
from servelm.cluster.spec import ClusterConfig, ReplicasConfig, RouterConfig
from servelm.ports import free_port_range
from servelm.server.launcher import ServerProcess, launch_server
from servelm.testing.tiny_model import write_tiny_checkpoint

MIN_UNCACHED = 64  # the router's --disagg-min-uncached-tokens here: the tiny model's "long" prompts are ~200+
REPLICA_ARGS = ("--num-blocks", "512", "--max-num-seqs", "8")


def _engine_has_roles() -> bool:
    try:
        build_parser().parse_args(["serve", "--kv-role", "prefill"])
    except SystemExit:
        return False
    return True


pytestmark = pytest.mark.skipif(
    not _engine_has_roles(), reason="`servelm serve --kv-role` does not exist yet (the engine side of issue 14)"
)


class PDFleet:
    def __init__(self, cluster: LocalCluster, reference: ServerProcess) -> None:
        self.cluster = cluster
        self.reference = reference
        self.router = cluster.urls()["router"]
        self.prefill = cluster.urls()["prefill-0"]
        self.decode = cluster.urls()["decode-0"]


@pytest.fixture(scope="module")
def pd_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDFleet]:
    root = tmp_path_factory.mktemp("pd_fleet")
    model = write_tiny_checkpoint(root / "model", seed=0)
    base = free_port_range(12)
    config = ClusterConfig(
        model=str(model), block_size=16, replicas=None,
        prefill=ReplicasConfig(count=1, base_port=base + 1, kv_events_base_port=base + 3, transfer_base_port=base + 5,
                               args=REPLICA_ARGS),
        decode=ReplicasConfig(count=1, base_port=base + 2, kv_events_base_port=base + 7, args=REPLICA_ARGS),
        router=RouterConfig(port=base, policy="kv", args=(
            "--health-interval", "0.5", "--disagg-min-uncached-tokens", str(MIN_UNCACHED))),
    )  # fmt: skip
    cluster = LocalCluster(config, root / "logs", startup_timeout_s=240)
    cluster.start()
    try:
        with launch_server(model, [*REPLICA_ARGS, "--num-threads", "1", "--block-size", "16"]) as reference:
            yield PDFleet(cluster, reference)
    finally:
        cluster.stop()


def document(i: int) -> str:
    """A prompt of a few hundred tokens, different from every other from its first block on."""
    return f"Report {i}. " + " ".join(f"item {i}-{j} weighs {(i * 31 + j * 7) % 97} grams" for j in range(40))


def complete(url: str, prompt: str, stream: bool = False) -> tuple[str, httpx.Headers]:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=180)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"], response.headers
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as response:
        assert response.status_code == 200, response.read()
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]), response.headers


def chat(url: str, content: str) -> tuple[str, httpx.Headers]:
    body = {"messages": [{"role": "user", "content": content}], "max_completion_tokens": 10, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=180)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"], response.headers


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    prefix = f"{name}{{{labels}" if labels else name
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def admin(fleet: PDFleet) -> dict[str, dict]:
    return {r["url"]: r for r in httpx.get(f"{fleet.router}/admin/replicas", timeout=10).json()["replicas"]}


def test_router_learns_roles_and_transfer_address(pd_fleet: PDFleet) -> None:
    replicas = admin(pd_fleet)
    assert replicas[pd_fleet.prefill]["role"] == "prefill"
    assert replicas[pd_fleet.prefill]["transfer_address"] == pd_fleet.cluster.config.transfer_addresses()[0]
    assert replicas[pd_fleet.decode]["role"] == "decode" and replicas[pd_fleet.decode]["transfer_address"] is None
    assert all(r["healthy"] for r in replicas.values())


def test_greedy_output_through_the_split_equals_a_plain_replica(pd_fleet: PDFleet) -> None:
    before = {
        reason: metric(pd_fleet.router, "servelm:router_disagg_decisions_total", f'decision="{d}",reason="{reason}"')
        for d, reason in (("disaggregated", "disaggregated"), ("aggregated", "short_prompt"))
    }
    cases = [("Hello there, how are", False, "short_prompt"), ("Count: one two three", True, "short_prompt")]
    cases += [(document(i), i % 2 == 1, "disaggregated") for i in range(4)]
    for prompt, stream, expected in cases:
        text, headers = complete(pd_fleet.router, prompt, stream)
        reference, _ = complete(pd_fleet.reference.base_url, prompt)
        assert text == reference, (expected, prompt[:40])
        assert headers["x-servelm-disagg"] == expected
        assert headers["x-servelm-replica"] == pd_fleet.decode  # never the prefill worker
        assert headers.get("x-servelm-prefill-replica") == (pd_fleet.prefill if expected == "disaggregated" else None)
    text, headers = chat(pd_fleet.router, document(10))
    assert headers["x-servelm-disagg"] == "disaggregated"
    assert text == chat(pd_fleet.reference.base_url, document(10))[0]
    after = {
        reason: metric(pd_fleet.router, "servelm:router_disagg_decisions_total", f'decision="{d}",reason="{reason}"')
        for d, reason in (("disaggregated", "disaggregated"), ("aggregated", "short_prompt"))
    }
    assert after["disaggregated"] - before["disaggregated"] == 5
    assert after["short_prompt"] - before["short_prompt"] == 2
    assert metric(pd_fleet.router, "servelm:router_prefill_calls_total", 'outcome="ok"') >= 5
    assert metric(pd_fleet.router, "servelm:router_prefill_calls_total", 'outcome="error"') == 0
    assert metric(pd_fleet.router, "servelm:router_prefill_in_flight") == 0
    assert metric(pd_fleet.router, "servelm:router_disagg_handoff_seconds_count") >= 1


def test_a_prompt_the_decode_worker_holds_stays_whole(pd_fleet: PDFleet) -> None:
    prompt = document(20)
    first, headers = complete(pd_fleet.router, prompt)
    assert headers["x-servelm-disagg"] == "disaggregated"
    # The decode worker now holds the prompt's blocks (pulled or computed); its KV events tell the router.
    num_tokens = httpx.post(f"{pd_fleet.decode}/tokenize", json={"prompt": prompt}, timeout=10).json()["count"]
    deadline = time.monotonic() + 20
    while admin(pd_fleet)[pd_fleet.decode]["kv_index_blocks"] < num_tokens // 16:
        assert time.monotonic() < deadline, "the decode worker's blocks never reached the router's index"
        time.sleep(0.1)
    again, headers = complete(pd_fleet.router, prompt)
    assert headers["x-servelm-disagg"] == "cached_on_decode"
    assert again == first


def test_a_constrained_request_keeps_its_schema_through_the_split(pd_fleet: PDFleet) -> None:
    """The decode worker holds the constraint: it samples every token, the first included, under the
    grammar (the prefill worker's one token is never shown), so the split output is the plain one."""
    schema = {"type": "object", "properties": {"verdict": {"enum": ["heavy", "light"]}, "sorted": {"type": "boolean"}},
              "required": ["verdict", "sorted"], "additionalProperties": False}  # fmt: skip
    body = {"messages": [{"role": "user", "content": document(40)}], "max_completion_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "report", "schema": schema, "strict": True}}}  # fmt: skip
    answers = []
    for url in (pd_fleet.router, pd_fleet.reference.base_url):
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=180)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice  # the grammar ended it
        answers.append((choice["message"]["content"], response.headers.get("x-servelm-disagg")))
    (split, decision), (plain, _) = answers
    assert decision == "disaggregated"
    assert split == plain and set(json.loads(split)) == {"verdict", "sorted"}


def test_a_dead_prefill_worker_costs_no_request(pd_fleet: PDFleet) -> None:
    """Runs last: it leaves the fleet without its prefill worker."""
    errors_before = metric(pd_fleet.router, "servelm:router_prefill_calls_total", 'outcome="error"')
    victim = next(p for p in pd_fleet.cluster.processes if p.spec.url == pd_fleet.prefill)
    victim.process.kill()
    victim.process.wait(timeout=30)
    prompt = document(30)
    text, headers = complete(pd_fleet.router, prompt)  # at once: the router most likely still counts it in
    assert text == complete(pd_fleet.reference.base_url, prompt)[0]
    assert headers["x-servelm-replica"] == pd_fleet.decode
    if headers["x-servelm-disagg"] == "disaggregated":  # the prefill call failed; the decode worker computed it
        assert metric(pd_fleet.router, "servelm:router_prefill_calls_total", 'outcome="error"') == errors_before + 1
    else:  # the health check was quicker
        assert headers["x-servelm-disagg"] == "no_prefill_worker"
    text, headers = complete(pd_fleet.router, document(31))
    assert headers["x-servelm-disagg"] == "no_prefill_worker" and not admin(pd_fleet)[pd_fleet.prefill]["healthy"]
    assert text == complete(pd_fleet.reference.base_url, document(31))[0]
