"""Chunks from S3 or any S3-compatible store (MinIO, Ceph RGW, R2, GCS's XML API): a ranged
GetObject each, through boto3.

    S3Source("models", "llama-70b/v3", connections=16)
      s3://models/llama-70b/v3/servelm-manifest.json   the manifest (uploaded with the files)
      s3://models/llama-70b/v3/<chunk.file>             GetObject Range: bytes=<offset>-<end - 1>

Credentials and region are found the boto3 way (environment, ~/.aws, instance role); the
endpoint is `endpoint_url`, else boto3's own AWS_ENDPOINT_URL / config file, else AWS. One
client (thread-safe) with a pool of `connections`. botocore's own retries are off: the puller
retries and counts every failed read, the same for every source.

boto3 is optional (`pip install servelm[s3]`): imported when an S3Source is made.
"""

from __future__ import annotations

from typing import Any

from servelm.delivery.manifest import MANIFEST_NAME, ChunkRef, Manifest, ManifestError
from servelm.delivery.source import FetchError, content_range_matches

_MISSING = {"NoSuchKey", "404", "NotFound"}


class S3Source:
    def __init__(
        self, bucket: str, prefix: str = "", endpoint_url: str | None = None, connections: int = 8,
        timeout_s: float = 60.0,
    ) -> None:  # fmt: skip
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:
            raise ImportError("s3:// sources need boto3: pip install servelm[s3]") from exc
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        config = Config(max_pool_connections=connections, retries={"mode": "standard", "total_max_attempts": 1},
                        connect_timeout=timeout_s, read_timeout=timeout_s)  # fmt: skip
        self._client: Any = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)
        self.description = f"s3://{bucket}/{self.prefix} ({self._client.meta.endpoint_url})"

    def _get(self, key: str, byte_range: str | None) -> tuple[dict[str, Any], bytes]:
        """GetObject and its whole body; botocore's and the transport's errors pass through."""
        kwargs = {"Range": byte_range} if byte_range else {}
        response = self._client.get_object(Bucket=self.bucket, Key=key, **kwargs)
        with response["Body"] as body:
            return response, body.read()

    def fetch_manifest(self) -> Manifest:
        from botocore.exceptions import BotoCoreError, ClientError

        key = self.prefix + MANIFEST_NAME
        try:
            _, data = self._get(key, None)
        except ClientError as exc:
            if _error_code(exc) in _MISSING:
                raise ManifestError(
                    f"s3://{self.bucket}/{key} does not exist: write the manifest with `servelm manifest DIR` and "
                    "upload it beside the model's files"
                ) from exc
            raise FetchError(f"s3://{self.bucket}/{key}: {exc}") from exc
        except (BotoCoreError, OSError) as exc:
            raise FetchError(f"s3://{self.bucket}/{key}: {exc!r}") from exc
        return Manifest.from_json(data, f"s3://{self.bucket}/{key}")

    def read(self, chunk: ChunkRef) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError

        key = self.prefix + chunk.file
        where = f"chunk {chunk.key} (bytes {chunk.offset}-{chunk.end - 1}) from s3://{self.bucket}/{key}"
        try:
            response, data = self._get(key, f"bytes={chunk.offset}-{chunk.end - 1}" if chunk.length else None)
        except ClientError as exc:
            if _error_code(exc) in _MISSING:
                raise FetchError(f"{where}: the file is missing at the origin") from exc
            raise FetchError(f"{where}: {exc}") from exc
        except (BotoCoreError, OSError) as exc:  # connection errors, a body cut short
            raise FetchError(f"{where}: {exc!r}") from exc
        if response.get("ContentRange") and not content_range_matches(response["ContentRange"], chunk):
            raise FetchError(f"{where}: got Content-Range {response['ContentRange']!r}")
        if len(data) != chunk.length:
            raise FetchError(f"{where}: {len(data)} bytes, expected {chunk.length}")
        return data

    def close(self) -> None:
        self._client.close()


def _error_code(error: Any) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))
