"""An ``s3://bucket/prefix`` downloaded with boto3 and the instance's credentials chain (an endpoint's execution
role, or any source botocore reads; ``AWS_ENDPOINT_URL_S3`` points it elsewhere).

Every object under the prefix is fetched through s3transfer's ``TransferManager``, all files submitted at once, so
its threads run ranged GETs of large shards and small files side by side; each file lands under a temporary name
and is renamed once whole (s3transfer's own rule), and a range whose connection is cut is fetched again (its
retries). Sizes are checked against the listing, and a manifest written last marks the folder complete: a start
that finds the manifest equal to the listing downloads nothing, and a start interrupted before it is not taken for
a complete model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from handler.config import Settings
from handler.download.files import check_space, disk_full, folder_bytes, serving_files
from handler.download.progress import Progress, say
from handler.errors import ConfigError

MANIFEST = ".s3-manifest.json"
CHUNK_BYTES = 32 << 20     # one ranged GET; a shard of several GB is many of them in parallel
CONCURRENCY = 16           # GETs in flight (network-bound: more threads than cores is right)


class NoCredentials(ConfigError):
    """No AWS credentials in the default chain: the server's setup, not what a caller named."""


class Unreachable(ConfigError):
    """S3 could not be reached (no endpoint, a connection that kept failing): not what a caller named."""


class S3Source:
    def __init__(self, url: str, settings: Settings) -> None:
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise ConfigError(f"option.model_id={url!r}: no bucket in the s3:// URL")
        self.bucket, self.settings = bucket, settings
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.name = f"s3://{bucket}/{self.prefix}"
        self.served_name = self.prefix.strip("/").rsplit("/", 1)[-1] or bucket
        root = Path(settings.download_dir) if settings.download_dir else Path.home() / ".cache" / "sagemaker-llm"
        self.folder = root / "s3" / bucket / self.prefix.strip("/")

    def fetch(self, progress: Progress) -> Path:
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        client = boto3.client("s3")
        try:
            listing = self._list(client)
            wanted = serving_files(sorted(listing), self.settings, self.name, everything=True)
            self._download(client, {path: listing[path] for path in wanted}, progress)
        except ClientError as error:
            code = error.response.get("Error", {}).get("Code", "?")
            raise ConfigError(f"{self.name}: S3 answered {code}: {error.response.get('Error', {}).get('Message')}"
                              ) from None
        except NoCredentialsError:
            raise NoCredentials(f"{self.name}: no AWS credentials found (an endpoint's execution role, "
                              "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ...)") from None
        except BotoCoreError as error:  # no endpoint, a connection that kept failing
            raise Unreachable(f"{self.name}: {error}") from None
        if self.settings.load_format == "pt" and not any(self.folder.glob("*.safetensors")):
            from handler.download.convert import convert_pickled

            return convert_pickled(self.folder, self.folder.with_name(self.folder.name + ".converted"))
        return self.folder

    def _list(self, client) -> dict[str, int]:
        """Relative path -> size of every object under the prefix."""
        listing = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
            for item in page.get("Contents", []):
                relative = item["Key"][len(self.prefix):]
                if relative and not relative.endswith("/"):
                    listing[relative] = item["Size"]
        if not listing:
            raise ConfigError(f"{self.name}: no objects under this prefix")
        return listing

    def _download(self, client, files: dict[str, int], progress: Progress) -> None:
        manifest = self.folder / MANIFEST
        if manifest.is_file() and json.loads(manifest.read_text()) == files and self._whole(files):
            say(f"{self.name}: already downloaded in {self.folder}")
            return
        manifest.unlink(missing_ok=True)  # incomplete from here until every file is whole
        missing = {p: size for p, size in files.items() if not self._whole({p: size})}
        self.folder.mkdir(parents=True, exist_ok=True)
        check_space(self.folder, sum(missing.values()), self.name)
        self._remove_strays(files)
        progress.track(sum(missing.values()), lambda: folder_bytes(self.folder), len(missing), str(self.folder))
        try:
            self._transfer(client, missing)
        except OSError as error:
            if error.errno == 28:  # ENOSPC
                raise disk_full(error, self.folder, self.name) from None
            raise
        if not self._whole(files):
            raise ConfigError(f"{self.name}: the downloaded files do not match the listing's sizes")
        partial = manifest.with_suffix(".partial")
        partial.write_text(json.dumps(files))
        os.replace(partial, manifest)

    def _transfer(self, client, files: dict[str, int]) -> None:
        from boto3.s3.transfer import TransferConfig
        from s3transfer.manager import TransferManager

        config = TransferConfig(multipart_threshold=CHUNK_BYTES, multipart_chunksize=CHUNK_BYTES,
                                max_concurrency=CONCURRENCY, num_download_attempts=5)
        with TransferManager(client, config) as manager:
            futures = []
            for path in files:
                target = self.folder / path
                target.parent.mkdir(parents=True, exist_ok=True)
                futures.append(manager.download(self.bucket, self.prefix + path, str(target),
                                                extra_args={}, subscribers=None))
            for future in futures:
                future.result()

    def _whole(self, files: dict[str, int]) -> bool:
        return all((self.folder / p).is_file() and (self.folder / p).stat().st_size == size
                   for p, size in files.items())

    def _remove_strays(self, files: dict[str, int]) -> None:
        """Files the listing does not name: an interrupted start's temporary names, or objects since deleted."""
        for path in [p for p in self.folder.rglob("*") if p.is_file()]:
            if path.relative_to(self.folder).as_posix() not in files:
                path.unlink()
