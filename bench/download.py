"""S3 download throughput (issue #28): our downloader against boto3's own transfer manager, same run, same data.

A 1 GB checkpoint split in 4 safetensors shards (plus its small files) sits in the S3 stand-in (moto's server on
loopback, tests/support/s3_stand_in.py). Each round downloads it into an empty folder twice, order alternating:
- ours: ``handler.download.s3.S3Source`` as a start runs it (every file submitted at once to one s3transfer
  ``TransferManager``: 32 MiB ranged GETs, 16 in flight);
- boto3: ``client.download_file`` per object, one after another, boto3's defaults (its transfer manager: 8 MiB
  ranged GETs, 10 in flight per file) — what a hand-written download script does.
The median round is printed, with the ratio. The stand-in is a Python server on the same 2 cores, so absolute
figures say more about it than about S3; the ratio is the result. Run: ``python -m bench.download``.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

ROUNDS = 3
SHARDS = 4
SHARD_BYTES = 256 << 20


def upload(stand_in, folder: Path) -> int:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tokenizer.json").write_bytes(os.urandom(2 << 20))
    for number in range(1, SHARDS + 1):
        with open(folder / f"model-{number:05d}-of-{SHARDS:05d}.safetensors", "wb") as shard:
            for _ in range(SHARD_BYTES // (16 << 20)):
                shard.write(os.urandom(16 << 20))
    stand_in.upload("bench", "model", folder)
    return sum(p.stat().st_size for p in folder.iterdir())


def ours(root: Path) -> None:
    from handler.config import Settings
    from handler.download.progress import Progress
    from handler.download.s3 import S3Source

    S3Source("s3://bench/model", Settings(download_dir=str(root))).fetch(Progress("bench", interval_s=3600))


def boto3_defaults(root: Path) -> None:
    import boto3

    client = boto3.client("s3")
    root.mkdir(parents=True)
    for item in client.list_objects_v2(Bucket="bench", Prefix="model/")["Contents"]:
        client.download_file("bench", item["Key"], str(root / item["Key"].rsplit("/", 1)[-1]))


def main() -> None:
    from tests.support.s3_stand_in import S3StandIn

    with S3StandIn() as stand_in, tempfile.TemporaryDirectory() as scratch:
        os.environ.update(stand_in.env)
        total = upload(stand_in, Path(scratch) / "source")
        shutil.rmtree(Path(scratch) / "source")
        times: dict[str, list[float]] = {"ours": [], "boto3": []}
        runs = {"ours": ours, "boto3": boto3_defaults}
        for round_number in range(ROUNDS):
            order = ["ours", "boto3"] if round_number % 2 == 0 else ["boto3", "ours"]
            for name in order:
                target = Path(scratch) / name
                started = time.perf_counter()
                runs[name](target)
                times[name].append(time.perf_counter() - started)
                shutil.rmtree(target)
    print(f"S3 download, {total / 1e9:.2f} GB in {SHARDS} shards + 2 small files, loopback moto stand-in, "
          f"median of {ROUNDS} rounds:")
    for name, label in (("ours", "ours (one TransferManager, all files at once)"),
                        ("boto3", "boto3 download_file per object (defaults)")):
        median = statistics.median(times[name])
        print(f"  {label:48s} {median:6.2f} s  {total / median / 1e6:7.1f} MB/s")
    print(f"  ours / boto3 throughput: {statistics.median(times['boto3']) / statistics.median(times['ours']):.2f}x")


if __name__ == "__main__":
    main()
