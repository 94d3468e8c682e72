"""Choosing a launcher by name (`servelm cluster --backend`), and the errors a user sees."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from servelm.cluster.launcher import LaunchOptions, make_launcher
from servelm.cluster.local import LocalCluster
from servelm.cluster.spec import ClusterConfig


def test_backends_by_name(tmp_path: Path) -> None:
    config = ClusterConfig()
    assert isinstance(make_launcher("local", config, LaunchOptions(tmp_path)), LocalCluster)
    with pytest.raises(ValueError, match="unknown placement backend 'kubernetes'; valid: local, ray"):
        make_launcher("kubernetes", config, LaunchOptions(tmp_path))
    with pytest.raises(ValueError, match="--address is for --backend ray"):
        make_launcher("local", config, LaunchOptions(tmp_path, address="127.0.0.1:6379"))


def test_the_ray_backend_without_ray_says_how_to_get_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets where Ray is not installed
    with pytest.raises(ImportError, match=r"--backend ray needs Ray: pip install 'servelm\[ray\]'"):
        make_launcher("ray", ClusterConfig(), LaunchOptions(tmp_path, address="127.0.0.1:6379"))
