"""The adapters' host cache (lora/registry.py) on real adapter files: at most --max-cpu-loras in host
memory, the least recently used out but never one a running request uses; an evicted adapter read
again in the background when asked for; an unloaded adapter kept while a request still uses it."""

from __future__ import annotations

from concurrent import futures

import pytest

from servelm.config import LoRAModule
from servelm.lora.adapter import LoRAAdapterError, load_lora_adapter
from servelm.lora.registry import AdapterRegistry
from servelm.models.arch import ModelArchConfig
from servelm.models.hf_loader import read_hf_config
from servelm.testing.lora_adapters import write_peft_adapter
from servelm.testing.tiny_model import write_tiny_checkpoint


@pytest.fixture(scope="module")
def modules(tmp_path_factory) -> tuple[ModelArchConfig, dict[str, LoRAModule]]:
    root = tmp_path_factory.mktemp("registry")
    arch = read_hf_config(write_tiny_checkpoint(root / "base", "llama", seed=1, num_hidden_layers=2))
    return arch, {name: LoRAModule(name, str(write_peft_adapter(root / name, arch, 4, seed=i)))
                  for i, name in enumerate(("a", "b", "c", "d"))}  # fmt: skip


def _registry(served: tuple[ModelArchConfig, dict[str, LoRAModule]], names: str,
              max_cpu_loras: int | None) -> AdapterRegistry:  # fmt: skip
    arch, modules = served
    return AdapterRegistry.at_start([modules[n] for n in names], lambda m: load_lora_adapter(m.name, m.path, arch, 16),
                                    max_cpu_loras)  # fmt: skip


def _settle_until_read(registry: AdapterRegistry, running: set[str]) -> None:
    futures.wait(registry.reads_in_flight(), timeout=30)
    registry.settle(running, running)


def test_the_host_cache_keeps_the_most_recent_and_reads_an_evicted_one_again(modules) -> None:
    registry = _registry(modules, "abc", max_cpu_loras=2)
    assert list(registry.host) == ["b", "c"] and registry.reads == 3  # all checked at start, "a" evicted
    assert registry.ready("b") and not registry.ready("a")  # "a" is being read again
    _settle_until_read(registry, running={"b"})
    assert list(registry.host) == ["b", "a"]  # "c" was least recently used; "b" runs
    assert registry.reads == 4 and registry.get("a").name == "a"


def test_a_run_time_load_never_evicts_a_running_requests_adapter(modules) -> None:
    registry = _registry(modules, "ab", max_cpu_loras=2)
    registry.get("a")  # "b" is now the least recently used...
    call = registry.start_load(modules[1]["c"])
    futures.wait([call.read], timeout=30)
    registry.finish_load(call, running={"b"})  # ...but a request runs with it
    assert set(registry.host) == {"b", "c"} and registry.is_served("a")


def test_an_unloaded_adapter_stays_while_a_request_uses_it(modules) -> None:
    registry = _registry(modules, "ab", max_cpu_loras=None)
    registry.unload("a")
    assert not registry.is_served("a") and registry.ready("a")  # its request in flight still gets it
    with pytest.raises(LoRAAdapterError, match="already loaded"):
        registry.start_load(modules[1]["a"])  # the name is taken until its requests are done
    assert registry.settle(running={"a"}, in_use={"a"}) == []
    assert registry.settle(running=set(), in_use=set()) == ["a"]  # its slot copy is stale now
    assert "a" not in registry.host
    with pytest.raises(KeyError):
        registry.unload("a")
