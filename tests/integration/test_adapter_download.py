"""An adapter's ``s3://`` src without credentials, in-process: the error ``POST /adapters`` answers with is this
function's, and the e2e servers cannot show it (their environment has the S3 stand-in's credentials)."""

from __future__ import annotations

from pathlib import Path

import pytest

from handler.config import Settings
from handler.download.adapter import adapter_folder
from handler.errors import EngineError


def test_without_credentials_an_s3_src_is_a_500_naming_src(tmp_path: Path, monkeypatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")   # no instance-metadata lookup from a test machine
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with pytest.raises(EngineError) as error:
        adapter_folder("s3://adapters/team/a1", Settings(download_dir=str(tmp_path / "cache")))
    assert error.value.param == "src" and error.value.status_code == 500
    assert error.value.message.startswith("src s3://adapters/team/a1: no AWS credentials found")
