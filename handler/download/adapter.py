"""Where a LoRA adapter's files are: the ``src`` of ``POST /adapters`` as a local folder.

A folder (``file://`` allowed) is served where it is. An ``s3://bucket/prefix`` is downloaded by the model
downloader's own machinery (``s3.S3Source``: s3transfer's ``TransferManager``, sizes checked against the listing, a
manifest written last) into the same cache (``option.download_dir``, else ``~/.cache/sagemaker-llm``), so a prefix
fetched once is a listing the next time. Workers and threads that fetch the same prefix at once take turns on a lock
file beside the folder: S3Source removes files the listing does not name, which would include another fetch's
temporary ones.

Errors name ``src``: a bucket or prefix that is not there (or holds no adapter) is the caller's 400; missing
credentials or an S3 that cannot be reached is the server's 500.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

from handler.config import Settings
from handler.errors import BadRequest, ConfigError, EngineError, ServingError


def adapter_folder(src: str, settings: Settings) -> Path:
    """The local folder holding ``src``'s files (downloaded first when ``src`` is an ``s3://`` prefix)."""
    if src.startswith("s3://"):
        return _fetch_s3(src, settings)
    if "://" in src and not src.startswith("file://"):
        raise BadRequest(f"src {src}: a local folder or an s3:// prefix", param="src")
    folder = Path(src.removeprefix("file://"))
    if not folder.is_dir():
        raise BadRequest(f"src {src}: no such folder", param="src")
    return folder


def _fetch_s3(src: str, settings: Settings) -> Path:
    from handler.download.progress import Progress, fetch_reported
    from handler.download.s3 import NoCredentials, S3Source, Unreachable

    if not src[len("s3://"):].partition("/")[0]:
        raise BadRequest(f"src {src}: no bucket in the s3:// URL", param="src")
    source = S3Source(src, settings)
    progress = Progress(source.name)
    lock_path = source.folder.with_name(source.folder.name + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return fetch_reported(source, progress)
    except ConfigError as error:
        message = f"src {src}: {str(error).removeprefix(source.name + ': ')}"
        kind: type[ServingError] = EngineError if isinstance(error, NoCredentials | Unreachable) else BadRequest
        raise kind(message, param="src") from None
    except OSError as error:  # the cache folder cannot be written
        raise EngineError(f"src {src}: cannot download to {source.folder} ({error.strerror})", param="src") from None
