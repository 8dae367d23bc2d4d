"""Models named by a Hub id (``org/name``) or an ``s3://`` prefix, downloaded at start.

The server's master downloads, before gunicorn forks a worker: once per start whatever the worker count, and a
download that fails ends the start with one line (``ConfigError``) and a non-zero exit. Meanwhile the port
answers ``/ping`` with 503 (``standby.Standby``), as SageMaker expects of a container that is not ready yet, and
the log shows bytes, rate and ETA at a steady interval (``progress.Progress``). Afterwards the settings point at
the local folder, and the workers run with ``HF_HUB_OFFLINE=1``: nothing past this step reaches the Hub.

A second start finds the files complete and downloads nothing; an interrupted one leaves nothing a later start
takes for complete (the Hub: huggingface_hub's ``.incomplete`` blobs, resumed; S3: s3transfer's temporary names,
renamed once whole, and our manifest written last).
"""

from __future__ import annotations

import os
import signal
import sys

from handler.config import Settings
from handler.config_sources import check_model_dir, is_remote
from handler.download.progress import Progress, fetch_reported
from handler.download.standby import Standby
from handler.errors import ConfigError


def fetch_model(settings: Settings) -> Settings:
    """The settings with ``option.model_id`` at a local folder: downloaded first when it names the Hub or S3."""
    if not is_remote(settings.model_id):
        return settings  # a folder: the environment as the user set it (a model.py may use the Hub itself)
    source = remote_source(settings)
    progress = Progress(source.name)
    with Standby(settings.host, settings.port, lambda: progress.status) as standby, stop_on_sigterm(source.name):
        folder = fetch_reported(source, progress)
    offline_from_now()
    fetched = settings.model_copy(update={"model_id": str(folder), "port": standby.port,
                                          "served_model_name": settings.served_model_name or source.served_name})
    check_model_dir(fetched)
    return fetched


def remote_source(settings: Settings):
    """The source ``option.model_id`` names (imported only then: boto3 and huggingface_hub stay off other starts)."""
    model_id = settings.model_id
    if model_id.startswith("s3://"):
        from handler.download.s3 import S3Source

        return S3Source(model_id, settings)
    if "://" in model_id:
        raise ConfigError(f"option.model_id={model_id!r}: not a folder, a Hub id (org/name) or an s3:// prefix")
    from handler.download.hub import HubSource

    return HubSource(model_id, settings)


def offline_from_now() -> None:
    """The workers serve the downloaded folder and never reach the Hub: set for them (and for the huggingface_hub the
    master imported, whose constants were read at import)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:
        constants.HF_HUB_OFFLINE = True


class stop_on_sigterm:  # noqa: N801 (a context manager, used as a statement)
    """SIGTERM while downloading (SageMaker stopping a start that overran): one line, then exit at once. Whatever
    is on disk is then incomplete by each source's own marks, never taken for a whole model later."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.previous = signal.signal(signal.SIGTERM, self._stop)

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGTERM, self.previous)

    def _stop(self, signum, frame) -> None:
        print(f"error: stopped (SIGTERM) while downloading {self.name}; the partial download is kept for a later "
              "start to resume, never served", file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)
