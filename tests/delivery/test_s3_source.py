"""S3Source against moto's S3 server (a real HTTP endpoint on a free port): `servelm pull
s3://bucket/prefix` with AWS_ENDPOINT_URL and dummy credentials, as against MinIO or AWS."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from delivery_helpers import same_files

from servelm.delivery.manifest import MANIFEST_NAME, ManifestError, read_manifest
from servelm.delivery.s3_source import S3Source
from servelm.delivery.source import FetchError

boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

BUCKET = "models"
PREFIX = "org/tiny v1"  # a space: keys are not URL paths, boto3 quotes them itself


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    port = _free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield env
    server.stop()


@pytest.fixture
def bucket(s3_env: dict[str, str], model_dir: Path) -> str:
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    for path in sorted(model_dir.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), BUCKET, f"{PREFIX}/{path.relative_to(model_dir).as_posix()}")
    return BUCKET


def test_servelm_pull_from_s3(bucket: str, model_dir: Path, tmp_path: Path, s3_env: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "servelm.cli", "pull", f"s3://{bucket}/{PREFIX}/", "--to", str(tmp_path / "dest"),
         "--connections", "4", "--no-progress"],
        capture_output=True, text=True, timeout=60, env={**s3_env, "PATH": "", "PYTHONPATH": ":".join(sys.path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "11 chunks fetched" in done.stdout
    assert same_files(model_dir, tmp_path / "dest")
    assert read_manifest(tmp_path / "dest") == read_manifest(model_dir)


def test_s3_errors(bucket: str, model_dir: Path) -> None:
    chunk = read_manifest(model_dir).file("config.json").chunks[0]
    source = S3Source(bucket, PREFIX, connections=2)
    assert source.read(chunk) == (model_dir / "config.json").read_bytes()
    boto3.client("s3").delete_object(Bucket=bucket, Key=f"{PREFIX}/config.json")
    with pytest.raises(FetchError, match="missing at the origin"):
        source.read(chunk)
    boto3.client("s3").delete_object(Bucket=bucket, Key=f"{PREFIX}/{MANIFEST_NAME}")
    with pytest.raises(ManifestError, match="servelm manifest"):
        source.fetch_manifest()
    source.close()
