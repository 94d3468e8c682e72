"""End to end on a real server: long documents arriving next to the same short requests → `scheduler`.

Baseline: short prompts at a steady rate. Current: the same short prompts at the same rate, and
prompts of several thousand tokens among them (a tenant that starts sending documents). The
arrival rate grows by a quarter and the typical (median) prompt not at all, so the diagnosis must
not say `load`; the short requests' queue and the prefill time grow: `scheduler`.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import httpx

from servelm.cli import main
from servelm.diagnose.capture import WindowRecorder

SHORT_RATE = 8.0  # requests / s
SECONDS = 2.5
LONG_EVERY = 4  # one long document per 4 short requests
LONG_WORDS = 7500  # ~1 token each: inside the test model's 8192-token context


async def _window(base_url: str, out: Path, label: str, with_documents: bool) -> None:
    rng = random.Random(label)
    words = ["alpha", "river", "stone", "cloud", "seven", "paper", "green", "light"]

    async def one(http: httpx.AsyncClient, delay_s: float, prompt: str) -> None:
        await asyncio.sleep(delay_s)
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text

    num_short = int(SHORT_RATE * SECONDS)
    jobs = [(i / SHORT_RATE, f"Short question number {i}: what is {rng.choice(words)}?") for i in range(num_short)]
    if with_documents:
        for i in range(0, num_short, LONG_EVERY):
            document = " ".join(rng.choice(words) for _ in range(LONG_WORDS))
            jobs.append(((i + 0.5) / SHORT_RATE, f"Document {rng.random()}: {document}\nSummarize it."))
    async with WindowRecorder(base_url, out, label, sample_interval_s=0.25):
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
            await asyncio.gather(*(one(http, delay, prompt) for delay, prompt in jobs))


def test_long_documents_next_to_short_requests_diagnose_as_scheduler(server, tmp_path: Path, capsys):
    asyncio.run(_window(server.base_url, tmp_path / "warmup", "warmup", with_documents=False))
    asyncio.run(_window(server.base_url, tmp_path / "baseline", "baseline", with_documents=False))
    asyncio.run(_window(server.base_url, tmp_path / "current", "current", with_documents=True))

    assert main(["diagnose", str(tmp_path / "baseline"), str(tmp_path / "current"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["top_cause"] == "scheduler", json.dumps(report, indent=1)
    assert report["ttft"]["grew"] and report["ttft"]["current"] > 2 * report["ttft"]["baseline"]
    top = report["causes"][0]
    assert set(top["components"]) & {"queue", "prefill"} and top["knob"]
    assert "load" not in [cause["name"] for cause in report["causes"]]
    assert main(["diagnose", str(tmp_path / "baseline"), str(tmp_path / "current")]) == 0
    text = capsys.readouterr().out
    assert "Top cause: scheduler" in text and "--long-prefill-token-threshold" in text
