"""The engine core in its own process behind ZMQ: outputs stream back; its death is an error, not a hang,
and a fresh core can replace it behind the same client."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from servelm.config import EngineConfig
from servelm.datatypes import EngineRequest, FinishReason
from servelm.engine.async_client import AsyncEngineClient, EngineDeadError, lost_with_core
from servelm.sampling_params import SamplingParams
from servelm.testing.tiny_model import write_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", seed=5)


def _request(request_id: str, max_tokens: int) -> EngineRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return EngineRequest(request_id=request_id, prompt_token_ids=list(range(10, 40)), sampling_params=params)


async def _collect(queue: asyncio.Queue) -> tuple[list[int], object]:
    tokens = []
    while True:
        output = await asyncio.wait_for(queue.get(), timeout=60)
        tokens.extend(output.new_token_ids)
        if output.finish_reason is not None:
            return tokens, output


def test_requests_stream_back_and_abort_frees_blocks(tiny_dir):
    async def scenario():
        client = AsyncEngineClient(EngineConfig.from_flat(model=str(tiny_dir), num_blocks=64, num_threads=1))
        ready = await client.start()
        try:
            assert ready.num_blocks == 64 and ready.vocab_size == 49152
            queues = [await client.add_request(_request(f"r{i}", 6 + i)) for i in range(4)]
            results = await asyncio.gather(*(_collect(q) for q in queues))
            for i, (tokens, last) in enumerate(results):
                assert len(tokens) == 6 + i and last.finish_reason == FinishReason.LENGTH
            # Identical prompts, greedy: identical prefixes of output.
            assert all(tokens[:6] == results[0][0][:6] for tokens, _ in results)
            long_queue = await client.add_request(_request("long", 500))
            await asyncio.wait_for(long_queue.get(), timeout=60)  # it is running
            await client.abort(["long"])
            for _ in range(100):  # the stats arrive with the next output batch of anyone
                if client.stats.num_used_blocks == 0 and client.stats.num_running == 0:
                    break
                await (await client.add_request(_request(f"probe{_}", 1))).get()
            assert client.stats.num_running == 0 and client.stats.num_used_blocks == 0
            assert client.num_in_flight == 0
        finally:
            await client.shutdown()

    asyncio.run(scenario())


def test_core_death_fails_every_request_and_a_restart_serves_again(tiny_dir):
    async def scenario():
        client = AsyncEngineClient(EngineConfig.from_flat(model=str(tiny_dir), num_blocks=64, num_threads=1))
        await client.start()
        try:
            with pytest.raises(RuntimeError):
                await client.restart()  # only a dead core is replaced
            expected, _ = await _collect(await client.add_request(_request("before", 8)))
            queues = [await client.add_request(_request(f"r{i}", 5000)) for i in range(3)]
            await asyncio.wait_for(queues[0].get(), timeout=60)
            first_pid = client.process_pid
            os.kill(first_pid, signal.SIGKILL)
            for queue in queues:
                while True:
                    output = await asyncio.wait_for(queue.get(), timeout=10)
                    if output.finish_reason is not None:
                        break
                assert output.finish_reason == FinishReason.ERROR and "died" in output.error
                assert lost_with_core(output.error)
            with pytest.raises(EngineDeadError):
                await client.add_request(_request("late", 1))
            ended = await asyncio.wait_for(client.wait_exit(), timeout=10)
            assert ended.exit_code == -signal.SIGKILL and ended.traceback is None
            assert client.stats.num_used_blocks == 0 and client.num_in_flight == 0
            ready = await client.restart()
            assert ready.num_blocks == 64 and client.process_pid != first_pid and client.dead_error is None
            tokens, last = await _collect(await client.add_request(_request("after", 8)))
            assert tokens == expected and last.finish_reason == FinishReason.LENGTH
        finally:
            await client.shutdown()

    asyncio.run(scenario())


def test_a_refused_request_fails_alone(tiny_dir):
    async def scenario():
        client = AsyncEngineClient(EngineConfig.from_flat(model=str(tiny_dir), num_blocks=64, num_threads=1))
        await client.start()
        try:
            good = await client.add_request(_request("good", 8))
            too_long = EngineRequest(
                request_id="too-long", prompt_token_ids=[5] * 2000, sampling_params=SamplingParams(max_tokens=4)
            )
            bad = await client.add_request(too_long)
            _, last = await _collect(bad)
            assert last.finish_reason == FinishReason.ERROR and "max_model_len" in last.error
            tokens, last = await _collect(good)
            assert len(tokens) == 8 and last.finish_reason == FinishReason.LENGTH
            assert client.dead_error is None
        finally:
            await client.shutdown()

    asyncio.run(scenario())


def test_core_ignores_sigint_so_the_api_can_drain(tiny_dir):
    async def scenario():
        client = AsyncEngineClient(EngineConfig.from_flat(model=str(tiny_dir), num_blocks=64, num_threads=1))
        await client.start()
        try:
            queue = await client.add_request(_request("r", 12))
            os.kill(client.process_pid, signal.SIGINT)  # what Ctrl-C sends to the process group
            tokens, last = await _collect(queue)
            assert len(tokens) == 12 and last.finish_reason == FinishReason.LENGTH
        finally:
            await client.shutdown()

    asyncio.run(scenario())
