"""Models from the Hub and S3, downloaded at start, through ``python -m handler serve`` against loopback stand-ins
(tests/support/hub_stand_in.py through ``HF_ENDPOINT``; moto's S3 server through ``AWS_ENDPOINT_URL_S3``).

Served from either source, a tiny checkpoint gives the greedy tokens it gives from its folder. /ping answers 503
while the download runs and the log shows its progress; a connection cut mid-shard is resumed; a start
interrupted by SIGTERM leaves nothing a later start serves as complete; a warm cache downloads nothing; each
refusal (unknown repo, missing revision, gated without a token, pickled weights only, a disk too small) is one
line and a non-zero exit. Settings that differ from the shipped ones, and why: ``HF_MODEL_ID`` (the source under
test) and ``OPTION_DOWNLOAD_DIR`` (a fresh cache per test, so no test sees another's download).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from tests.e2e.conftest import REPO_ROOT, free_port, start_server, stop_server
from tests.e2e.test_model_reach import served_tokens
from tests.support.hub_stand_in import HubStandIn
from tests.support.s3_stand_in import S3StandIn
from tests.support.tiny_checkpoints import build_tiny

PROMPT = "The weather today is"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny checkpoints that answer differently (``main`` and revision ``v1``), and ``main`` with its weights
    pickled instead (``pytorch_model.bin``)."""
    root = tmp_path_factory.mktemp("checkpoints")
    main = build_tiny(root / "main", "llama")
    other = build_tiny(root / "v1", "llama", intermediate_size=96)
    pickled = root / "pickled"
    shutil.copytree(main, pickled)
    from safetensors.torch import load_file

    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    return {"main": main, "v1": other, "pickled": pickled}


@pytest.fixture(scope="module")
def expected(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Greedy tokens of each checkpoint served from its folder (the shipped settings)."""
    tokens = {}
    for name in ("main", "v1"):
        server = start_server(tmp_path_factory.mktemp(f"folder-{name}"), {"HF_MODEL_ID": str(checkpoints[name])})
        try:
            tokens[name] = served_tokens(server.url, PROMPT, 12)
        finally:
            stop_server(server)
    assert tokens["main"] != tokens["v1"]  # else the revision test could not tell them apart
    return tokens


@pytest.fixture(scope="module")
def hub(checkpoints: dict[str, Path]):
    with HubStandIn() as stand_in:
        stand_in.add("org/tiny", checkpoints["main"])
        stand_in.add("org/tiny", checkpoints["v1"], revision="v1")
        stand_in.add("org/gated", checkpoints["main"], gated=True)
        stand_in.add("org/pickled", checkpoints["pickled"])
        stand_in.add("org/huge", checkpoints["main"])
        yield stand_in


def hub_env(hub: HubStandIn, cache: Path, repo: str, **extra: str) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.url, "HF_MODEL_ID": repo, "OPTION_DOWNLOAD_DIR": str(cache), "HF_TOKEN": "",
            "HF_HUB_OFFLINE": "0", **extra}


def serve_and_fail(tmp_path: Path, env: dict[str, str]) -> tuple[int, list[str]]:
    environ = {**os.environ, "SAGEMAKER_BIND_TO_PORT": str(free_port()), "SERVER_HOST": "127.0.0.1",
               "SAGEMAKER_MODEL_DIR": str(tmp_path / "no-sagemaker-model"), **env}
    done = subprocess.run([sys.executable, "-m", "handler", "serve"], cwd=REPO_ROOT, env=environ,
                          capture_output=True, text=True, timeout=180)
    return done.returncode, (done.stdout + done.stderr).splitlines()


def one_error_line(code: int, lines: list[str]) -> str:
    assert code != 0
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in "\n".join(lines), lines
    return errors[0]


def watch_start(tmp_path: Path, env: dict[str, str]) -> tuple[object, list[requests.Response]]:
    """Start the server while polling its port: the running server, and the answers /ping gave before it was
    ready."""
    port = free_port()
    answers: list[requests.Response] = []
    with ThreadPoolExecutor(1) as pool:
        starting = pool.submit(start_server, tmp_path, env, port)
        while not starting.done():
            try:
                answers.append(requests.get(f"http://127.0.0.1:{port}/ping", timeout=2))
            except requests.RequestException:
                pass
            time.sleep(0.2)
        return starting.result(), answers


def test_a_hub_id_downloads_while_ping_says_503_and_serves_the_folders_tokens(
        hub: HubStandIn, expected: dict[str, list[int]], tmp_path: Path) -> None:
    hub.requests.clear()
    hub.cut_once.add("model.safetensors")       # the first GET of the shard stops half-way: resumed
    hub.slow["model.safetensors"] = 7.0         # long enough for a progress line and a few pings
    try:
        server, pings = watch_start(tmp_path, hub_env(hub, tmp_path / "cache", "org/tiny"))
    finally:
        hub.slow.clear()
    try:
        tokens = served_tokens(server.url, PROMPT, 12)
        card = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
        log = server.log()
    finally:
        stop_server(server)
    assert tokens == expected["main"]
    assert card["id"] == "org/tiny"
    busy = [r for r in pings if r.status_code == 503]
    assert busy and "downloading" in busy[0].json()["error"]["message"]
    assert "download: downloading org/tiny: 6 files" in log and "download: downloaded org/tiny" in log
    assert any("%" in line and "/s, ETA" in line for line in log.splitlines())  # a progress line on the interval
    assert "Trying to resume download" in log and hub.downloads().count("model.safetensors") == 2


def test_a_warm_cache_downloads_nothing(hub: HubStandIn, expected: dict[str, list[int]], tmp_path: Path) -> None:
    env = hub_env(hub, tmp_path / "cache", "org/tiny")
    code, lines = serve_and_fail(tmp_path, {**env, "OPTION_MAX_MODEL_LEN": "9999999"})  # downloads, then refuses
    assert code != 0 and hub.downloads()
    hub.requests.clear()
    server = start_server(tmp_path, env)
    try:
        assert served_tokens(server.url, PROMPT, 12) == expected["main"]
        assert "complete in the cache" in server.log()
    finally:
        stop_server(server)
    assert hub.downloads() == []


def test_a_revision_serves_that_revision(hub: HubStandIn, expected: dict[str, list[int]], tmp_path: Path) -> None:
    server = start_server(tmp_path, hub_env(hub, tmp_path / "cache", "org/tiny", HF_MODEL_REVISION="v1"))
    try:
        assert served_tokens(server.url, PROMPT, 12) == expected["v1"]
    finally:
        stop_server(server)


def test_a_gated_repo_needs_a_token(hub: HubStandIn, expected: dict[str, list[int]], tmp_path: Path) -> None:
    env = hub_env(hub, tmp_path / "cache", "org/gated")
    line = one_error_line(*serve_and_fail(tmp_path, env))
    assert "org/gated is a gated repo: set HF_TOKEN" in line
    line = one_error_line(*serve_and_fail(tmp_path, {**env, "HF_TOKEN": "hf_someone_else"}))
    assert "has no access" in line and "hf_someone_else" not in line
    server = start_server(tmp_path, {**env, "HF_TOKEN": "hf_valid_token"})
    try:
        assert served_tokens(server.url, PROMPT, 12) == expected["main"]
        assert "hf_valid_token" not in server.log()
    finally:
        stop_server(server)


@pytest.mark.parametrize(("repo", "extra", "named"), [
    ("org/missing", {}, "option.model_id='org/missing': no such repo on http://127.0.0.1"),
    ("org/tiny", {"OPTION_REVISION": "v9"}, "org/tiny has no revision 'v9' (option.revision / HF_MODEL_REVISION)"),
    ("org/pickled", {}, "only pickled weights (pytorch_model.bin), which run code when loaded; set "
                        "option.load_format=pt"),
    ("org/huge", {}, "needs 1000000.00 GB and"),
    ("org/tiny", {"HF_HUB_OFFLINE": "1"}, "org/tiny is not in the Hub cache at"),
])
def test_a_hub_start_that_cannot_succeed_is_one_line(hub: HubStandIn, tmp_path: Path, repo: str, extra: dict,
                                                      named: str) -> None:
    if repo == "org/huge":  # the listing claims a petabyte shard: the disk check refuses before any GET
        hub.claimed_sizes["model.safetensors"] = 10**15
    try:
        line = one_error_line(*serve_and_fail(tmp_path, hub_env(hub, tmp_path / "cache", repo, **extra)))
    finally:
        hub.claimed_sizes.clear()
    assert named in line


def test_pickled_weights_are_converted_when_asked(hub: HubStandIn, expected: dict[str, list[int]],
                                                  tmp_path: Path) -> None:
    server = start_server(tmp_path, hub_env(hub, tmp_path / "cache", "org/pickled", OPTION_LOAD_FORMAT="pt"))
    try:
        assert served_tokens(server.url, PROMPT, 12) == expected["main"]
    finally:
        stop_server(server)


def test_sigterm_mid_download_leaves_nothing_served_as_complete(hub: HubStandIn, expected: dict[str, list[int]],
                                                                 tmp_path: Path) -> None:
    env = hub_env(hub, tmp_path / "cache", "org/tiny")
    port = free_port()
    hub.slow["model.safetensors"] = 30.0
    try:
        process = subprocess.Popen([sys.executable, "-m", "handler", "serve"], cwd=REPO_ROOT, text=True,
                                   env={**os.environ, **env, "SAGEMAKER_BIND_TO_PORT": str(port),
                                        "SERVER_HOST": "127.0.0.1", "SAGEMAKER_MODEL_DIR": str(tmp_path / "none")},
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wait_for_status(port, 503)
        time.sleep(2)  # some of the shard has landed
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        hub.slow.clear()
    assert process.returncode == 128 + signal.SIGTERM
    assert "error: stopped (SIGTERM) while downloading org/tiny" in output
    line = one_error_line(*serve_and_fail(tmp_path, {**env, "HF_HUB_OFFLINE": "1"}))
    assert "not in the Hub cache" in line  # the partial shard is not a model
    server = start_server(tmp_path, env)  # online again: resumed, and whole
    try:
        assert served_tokens(server.url, PROMPT, 12) == expected["main"]
    finally:
        stop_server(server)


def wait_for_status(port: int, status: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/ping", timeout=2).status_code == status:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise AssertionError(f"/ping never answered {status}")


@pytest.fixture(scope="module")
def s3(checkpoints: dict[str, Path]):
    with S3StandIn() as stand_in:
        stand_in.upload("models", "tiny", checkpoints["main"])
        yield stand_in


def test_an_s3_prefix_is_downloaded_resumed_after_a_cut_and_served_exactly(
        s3: S3StandIn, expected: dict[str, list[int]], tmp_path: Path) -> None:
    env = {**s3.env, "HF_MODEL_ID": "s3://models/tiny", "OPTION_DOWNLOAD_DIR": str(tmp_path / "cache")}
    s3.proxy.cut_after = 5_000_000  # the shard's GET loses its connection after 5 MB: s3transfer fetches it again
    server = start_server(tmp_path, env)
    try:
        assert served_tokens(server.url, PROMPT, 12) == expected["main"]
        card = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
        assert "download: downloaded s3://models/tiny/" in server.log()
    finally:
        stop_server(server)
    assert s3.proxy.cuts == 1 and card["id"] == "tiny"
    answered = s3.proxy.answered
    server = start_server(tmp_path, env)  # warm: a listing, no object
    try:
        assert "already downloaded" in server.log()
    finally:
        stop_server(server)
    assert s3.proxy.answered - answered < 100_000


def test_an_s3_download_stopped_by_sigterm_is_completed_by_the_next_start(
        s3: S3StandIn, expected: dict[str, list[int]], tmp_path: Path) -> None:
    env = {**os.environ, **s3.env, "HF_MODEL_ID": "s3://models/tiny", "OPTION_DOWNLOAD_DIR": str(tmp_path / "cache"),
           "SERVER_HOST": "127.0.0.1", "SAGEMAKER_MODEL_DIR": str(tmp_path / "none")}
    port = free_port()
    s3.proxy.bytes_per_s = 2_000_000
    try:
        process = subprocess.Popen([sys.executable, "-m", "handler", "serve"], cwd=REPO_ROOT, text=True,
                                   env={**env, "SAGEMAKER_BIND_TO_PORT": str(port)},
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wait_for_status(port, 503)
        time.sleep(2)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        s3.proxy.bytes_per_s = None
    assert process.returncode == 128 + signal.SIGTERM, output
    folder = tmp_path / "cache" / "s3" / "models" / "tiny"
    assert not (folder / ".s3-manifest.json").exists()
    assert not (folder / "model.safetensors").exists()  # only s3transfer's temporary name, never the shard's
    server = start_server(tmp_path, {k: env[k] for k in ("HF_MODEL_ID", "OPTION_DOWNLOAD_DIR")} | s3.env)
    try:
        assert served_tokens(server.url, PROMPT, 12) == expected["main"]
    finally:
        stop_server(server)


def test_s3_refusals_are_one_line(s3: S3StandIn, tmp_path: Path) -> None:
    env = {**s3.env, "OPTION_DOWNLOAD_DIR": str(tmp_path / "cache")}
    line = one_error_line(*serve_and_fail(tmp_path, {**env, "HF_MODEL_ID": "s3://nobucket/m"}))
    assert "s3://nobucket/m/: S3 answered NoSuchBucket" in line
    line = one_error_line(*serve_and_fail(tmp_path, {**env, "HF_MODEL_ID": "s3://models/absent"}))
    assert "s3://models/absent/: no objects under this prefix" in line
    line = one_error_line(*serve_and_fail(tmp_path, {**env, "HF_MODEL_ID": "s3://models/tiny",
                                                     "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "",
                                                     "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                                                     "AWS_CONFIG_FILE": str(tmp_path / "none")}))
    assert "no AWS credentials found" in line
