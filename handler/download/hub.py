"""A Hub id (``org/name``) downloaded with huggingface_hub, which honours ``HF_ENDPOINT``, ``HF_HUB_OFFLINE``,
``HF_TOKEN`` / ``HUGGING_FACE_HUB_TOKEN`` (never logged here) and its cache (``HF_HOME``; ``option.download_dir``
overrides). Only the files serving reads are fetched (``serving_files``). Each way it can fail is one line:
an unknown repo, a revision it does not have, a gated repo without access, no space, no connection.
"""

from __future__ import annotations

from pathlib import Path

from handler.config import Settings
from handler.download.files import check_space, disk_full, folder_bytes, serving_files
from handler.download.progress import Progress, say
from handler.errors import ConfigError


class HubSource:
    def __init__(self, repo_id: str, settings: Settings) -> None:
        self.repo_id, self.settings = repo_id, settings
        self.revision = settings.revision or "main"
        self.name = f"{repo_id}@{self.revision}" if settings.revision else repo_id
        self.served_name = repo_id

    @property
    def cache_dir(self) -> Path:
        from huggingface_hub import constants

        return Path(self.settings.download_dir or constants.HF_HUB_CACHE)

    def fetch(self, progress: Progress) -> Path:
        from huggingface_hub import constants
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()  # our one line at an interval instead of a bar per file
        if constants.HF_HUB_OFFLINE:
            return self._cached()
        try:
            return self._download(progress)
        except ConfigError:
            raise
        except Exception as error:  # huggingface_hub's HTTP errors are OSErrors, httpx's connection errors are not
            raise self._one_line(error) from None

    def _download(self, progress: Progress) -> Path:
        from huggingface_hub import HfApi, snapshot_download
        from huggingface_hub.hf_api import RepoFile

        api = HfApi()
        commit = api.repo_info(self.repo_id, revision=self.revision).sha
        listing = {f.path: f.size for f in api.list_repo_tree(self.repo_id, revision=commit, recursive=True)
                   if isinstance(f, RepoFile)}
        wanted = serving_files(sorted(listing), self.settings, self.name)
        storage = self.cache_dir / f"models--{self.repo_id.replace('/', '--')}"
        missing = [p for p in wanted if not (storage / "snapshots" / commit / p).is_file()]
        if missing:
            total = sum(listing[p] for p in missing)
            check_space(self.cache_dir, total, self.name)
            progress.track(total, lambda: folder_bytes(storage / "blobs"), len(missing), str(self.cache_dir))
        else:
            say(f"{self.name}: complete in the cache at {self.cache_dir}")
        try:
            folder = snapshot_download(self.repo_id, revision=self.revision, cache_dir=str(self.cache_dir),
                                       allow_patterns=[glob_literal(p) for p in wanted], max_workers=8)
        except OSError as error:
            if error.errno == 28:  # ENOSPC
                raise disk_full(error, self.cache_dir, self.name) from None
            raise
        return self._converted(Path(folder))

    def _cached(self) -> Path:
        """HF_HUB_OFFLINE=1: the cached snapshot, or one line saying it is not there."""
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(self.repo_id, revision=self.revision, cache_dir=str(self.cache_dir),
                                            local_files_only=True))
        except OSError:
            raise ConfigError(f"{self.name} is not in the Hub cache at {self.cache_dir}, and HF_HUB_OFFLINE=1 "
                              "forbids downloading it (unset HF_HUB_OFFLINE, or fill the cache first)") from None
        say(f"{self.name}: from the cache at {folder} (HF_HUB_OFFLINE=1)")
        return self._converted(folder)

    def _converted(self, folder: Path) -> Path:
        if self.settings.load_format == "pt" and not any(folder.glob("*.safetensors")):
            from handler.download.convert import convert_pickled

            return convert_pickled(folder, self.cache_dir / "converted" / self.repo_id.replace("/", "--") /
                                   folder.name)
        return folder

    def _one_line(self, error: Exception) -> ConfigError:
        """huggingface_hub's errors (HTTP, connection, cache), each as what the user must change."""
        from huggingface_hub import constants
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
        from huggingface_hub.utils import get_token

        if isinstance(error, GatedRepoError):
            if get_token() is None:
                return ConfigError(f"{self.repo_id} is a gated repo: set HF_TOKEN to a token of an account that "
                                   "has accepted its terms")
            return ConfigError(f"{self.repo_id} is a gated repo and the token in HF_TOKEN has no access to it: "
                               "accept its terms on the Hub with that account")
        if isinstance(error, RevisionNotFoundError):
            return ConfigError(f"{self.repo_id} has no revision {self.revision!r} (option.revision / "
                               "HF_MODEL_REVISION)")
        if isinstance(error, RepositoryNotFoundError):
            hint = "" if get_token() else ", or it is private and HF_TOKEN is unset"
            return ConfigError(f"option.model_id={self.repo_id!r}: no such repo on {constants.ENDPOINT}{hint}")
        if isinstance(error, HfHubHTTPError):
            status = error.response.status_code if error.response is not None else "?"
            return ConfigError(f"{self.name}: {constants.ENDPOINT} answered HTTP {status}")
        return ConfigError(f"{self.name}: cannot download from {constants.ENDPOINT}: "
                           f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")


def glob_literal(path: str) -> str:
    """A file name as a pattern that matches only itself (allow_patterns are fnmatch globs)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in path)
