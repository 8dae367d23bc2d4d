"""Metrics, request records and their settings: what each request and engine step adds, the JSON log line, the
multiprocess folder the gunicorn master prepares, and the settings for limits and logging."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from handler import metrics, request_log
from handler.__main__ import gunicorn_options, prepare_metrics_dir
from handler.config import Settings
from handler.config_sources import load_settings
from handler.engine.backend import EngineStats
from handler.engine.types import ErrorKind, FinishReason, GenerationRequest, TokenEvent
from handler.errors import ConfigError, GatewayTimeout
from handler.request_log import JsonFormatter, ObservedHandle, RequestRecord

REPO_ROOT = Path(__file__).resolve().parents[2]


def sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels or None) or 0.0


# ---- settings -------------------------------------------------------------------------------------------------

@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    props = tmp_path / "serving.properties"
    props.write_text("")
    return {"SERVING_PROPERTIES": str(props), "SAGEMAKER_MODEL_DIR": str(tmp_path / "none"), "HF_MODEL_ID": str(model)}


def test_limit_and_log_defaults(env: dict[str, str]) -> None:
    settings = load_settings(env)
    assert (settings.max_queue_size, settings.request_timeout) == (64, 60.0)
    assert (settings.log_level, settings.log_prompts) == ("info", False)


@pytest.mark.parametrize(("extra", "field", "expected"), [
    ({"MAX_CONCURRENT_REQUESTS": "7"}, "max_queue_size", 7),                                  # TGI's name
    ({"MAX_CONCURRENT_REQUESTS": "7", "OPTION_MAX_QUEUE_SIZE": "3"}, "max_queue_size", 3),    # ours wins
    ({"SAGEMAKER_MODEL_SERVER_TIMEOUT": "30"}, "request_timeout", 30.0),
    ({"SAGEMAKER_MODEL_SERVER_TIMEOUT": "30", "OPTION_REQUEST_TIMEOUT": "2.5"}, "request_timeout", 2.5),
    ({"SAGEMAKER_CONTAINER_LOG_LEVEL": "20"}, "log_level", "info"),
    ({"SAGEMAKER_CONTAINER_LOG_LEVEL": "40"}, "log_level", "error"),
    ({"SAGEMAKER_CONTAINER_LOG_LEVEL": "WARNING"}, "log_level", "warning"),
    ({"SAGEMAKER_CONTAINER_LOG_LEVEL": "10", "OPTION_LOG_LEVEL": "warn"}, "log_level", "warning"),
    ({"OPTION_LOG_PROMPTS": "true"}, "log_prompts", True),
])
def test_limit_and_log_settings_from_the_environment(env, extra, field: str, expected) -> None:
    assert getattr(load_settings({**env, **extra}), field) == expected


@pytest.mark.parametrize(("extra", "key"), [
    ({"OPTION_MAX_QUEUE_SIZE": "0"}, "option.max_queue_size"),
    ({"OPTION_REQUEST_TIMEOUT": "0"}, "option.request_timeout"),
    ({"SAGEMAKER_CONTAINER_LOG_LEVEL": "loud"}, "option.log_level"),
])
def test_bad_limit_or_log_setting_names_the_key(env, extra, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_settings({**env, **extra})


# ---- the request record and its log line ------------------------------------------------------------------------

def token(index: int, token_id: int = 5) -> TokenEvent:
    return TokenEvent(index=index, token_id=token_id, text="x")


def final(index: int, reason: FinishReason = FinishReason.LENGTH, generated: int = 2, error: str | None = None,
          kind: ErrorKind = ErrorKind.MODEL):
    return TokenEvent(index=index, token_id=None, text="", finish_reason=reason, error=error,
                      error_kind=kind if error else None, num_prompt_tokens=3, num_generated_tokens=generated)


def test_record_times_tokens_per_choice() -> None:
    record = RequestRecord("r", "/invocations", started=10.0)
    assert record.on_event(1, token(0), 11.0) is None          # first token: no gap, sets TTFT
    assert record.on_event(1, token(1), 11.5) is None          # the other choice's first token
    assert record.on_event(1, token(0), 12.25) == pytest.approx(1.25)
    assert record.on_event(1, final(0), 12.5) is None
    assert record.on_event(1, final(1, FinishReason.EOS, 1), 12.5) is None
    line = record.to_log(200, now=13.0)
    assert line == {"event": "request", "request_id": "r", "pid": os.getpid(), "route": "/invocations",
                    "schema": "none", "stream": False,
                    "status": 200, "prompt_tokens": 0, "completion_tokens": 3, "ttft_s": 1.0, "total_s": 3.0,
                    "finish_reason": "length,eos"}


def test_prompt_is_logged_only_when_set() -> None:
    record = RequestRecord("r", "/invocations", started=0.0)
    assert "prompt" not in record.to_log(200, 1.0)
    record.prompt = "secret"
    assert record.to_log(200, 1.0)["prompt"] == "secret"


def test_json_formatter_writes_one_line_with_time_level_and_fields() -> None:
    entry = logging.LogRecord("handler.requests", logging.INFO, __file__, 1, "request", None, None)
    entry.fields = {"request_id": "r", "status": 200}
    text = JsonFormatter().format(entry)
    assert "\n" not in text
    parsed = json.loads(text)
    assert parsed["level"] == "INFO" and parsed["request_id"] == "r" and parsed["status"] == 200
    assert parsed["time"].endswith("+00:00")


def test_finish_logs_and_counts_the_request() -> None:
    lines: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = lines.append
    request_log.log.addHandler(handler)
    level = request_log.log.level
    request_log.log.setLevel(logging.INFO)
    try:
        before = sample("llm_requests_total", route="/t", schema="chat", status="200")
        record = request_log.start("chatcmpl-1", "/t")
        record.schema = "chat"
        record.on_event(1, final(0), record.started + 1)
        request_log.finish(record, 200)
    finally:
        request_log.log.removeHandler(handler)
        request_log.log.setLevel(level)
    assert sample("llm_requests_total", route="/t", schema="chat", status="200") == before + 1
    assert lines[-1].fields["request_id"] == "chatcmpl-1" and lines[-1].fields["finish_reason"] == "length"


class ScriptedHandle:
    def __init__(self, events: list[TokenEvent]) -> None:
        self.request = GenerationRequest("g", prompt_ids=(1, 2, 3))
        self.events = events
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    def __iter__(self):
        return iter(self.events)


def test_observed_handle_turns_an_engine_timeout_into_504() -> None:
    record = RequestRecord("r", "/invocations", started=0.0)
    message = "request timed out after 5 s (option.request_timeout)"
    timed_out = final(0, FinishReason.ERROR, 1, message, ErrorKind.TIMEOUT)
    handle = ObservedHandle(ScriptedHandle([token(0), timed_out]), record)
    before = sample("llm_request_timeouts_total")
    with pytest.raises(GatewayTimeout, match="timed out after 5 s") as info:
        list(handle)
    assert info.value.status_code == 504
    assert sample("llm_request_timeouts_total") == before + 1
    assert record.num_prompt_tokens == 3 and record.finish_reason == "error"


def test_observed_handle_passes_a_deadline_cut_on_as_length_and_counts_it() -> None:
    record = RequestRecord("r", "/invocations", started=0.0)
    handle = ObservedHandle(ScriptedHandle([token(0), final(0, FinishReason.DEADLINE, 1)]), record)
    before = sample("llm_request_timeouts_total")
    events = list(handle)
    assert [e.finish_reason for e in events] == [None, FinishReason.LENGTH]
    assert record.cut_by_deadline and record.finish_reason == "deadline"
    assert sample("llm_request_timeouts_total") == before + 1


def test_observed_handle_passes_other_errors_and_marks_a_reader_that_left() -> None:
    record = RequestRecord("r", "/invocations", started=0.0)
    failed = ObservedHandle(ScriptedHandle([final(0, FinishReason.ERROR, 0, "model step failed")]), record)
    assert [e.error for e in failed] == ["model step failed"]
    left = iter(ObservedHandle(ScriptedHandle([token(0), token(0), final(0)]), record))
    next(left)
    left.close()  # the response generator was closed: the client went away
    assert record.finish_reasons == ["error", "abort"]


# ---- engine steps ---------------------------------------------------------------------------------------------

def test_record_step_sets_gauges_and_observes_batches() -> None:
    batches = sample("llm_batch_size_count")
    tokens = sample("llm_engine_generated_tokens_total")
    metrics.record_step(EngineStats(num_running=3, num_waiting=2, batch_size=4, num_sampled=4,
                                    kv_cache_used_bytes=100, kv_cache_allocated_bytes=400))
    assert (sample("llm_running_requests"), sample("llm_waiting_requests")) == (3, 2)
    assert (sample("llm_kv_cache_used_bytes"), sample("llm_kv_cache_allocated_bytes")) == (100, 400)
    assert sample("llm_batch_size_count") == batches + 1
    assert sample("llm_engine_generated_tokens_total") == tokens + 4
    metrics.record_step(EngineStats(0, 0, 0, 0, 0, 0))  # idle: gauges at zero, no batch observed
    assert sample("llm_running_requests") == 0 and sample("llm_batch_size_count") == batches + 1


def test_image_fetch_failures_count_by_reason() -> None:
    before = sample("llm_image_fetch_failures_total", reason="timeout")
    metrics.record_image_fetch_failure("timeout")
    assert sample("llm_image_fetch_failures_total", reason="timeout") == before + 1


def test_render_lists_every_metric_with_the_prefix() -> None:
    text = metrics.render().decode()
    for name in ("llm_requests_total", "llm_request_duration_seconds", "llm_time_to_first_token_seconds",
                 "llm_inter_token_latency_seconds", "llm_prompt_tokens", "llm_generated_tokens",
                 "llm_running_requests", "llm_waiting_requests", "llm_batch_size", "llm_kv_cache_used_bytes",
                 "llm_queue_rejections_total", "llm_request_timeouts_total", "llm_image_fetch_failures_total"):
        assert f"# TYPE {name} " in text, name


# ---- multiprocess mode (gunicorn workers) -------------------------------------------------------------------------

def test_master_makes_a_fresh_folder_or_empties_the_named_one(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    made = prepare_metrics_dir(environ)
    assert made is not None and made.is_dir() and environ["PROMETHEUS_MULTIPROC_DIR"] == str(made)
    made.rmdir()
    named = tmp_path / "prom"
    named.mkdir()
    (named / "counter_1.db").write_bytes(b"old")
    (named / "keep.txt").write_text("not ours")
    assert prepare_metrics_dir({"PROMETHEUS_MULTIPROC_DIR": str(named)}) is None
    assert sorted(p.name for p in named.iterdir()) == ["keep.txt"]


def test_gunicorn_marks_dead_workers() -> None:
    assert gunicorn_options(Settings(host="127.0.0.1"))["child_exit"].__name__ == "worker_exited"


def test_gunicorn_opens_no_shared_control_socket() -> None:
    assert gunicorn_options(Settings(host="127.0.0.1"))["control_socket_disable"] is True


WORKERS_SCRIPT = textwrap.dedent("""
    import os, sys, types
    from handler.__main__ import worker_exited
    from handler import metrics
    from handler.engine.backend import EngineStats
    pids = []
    for running in (2, 3):
        pid = os.fork()
        if pid == 0:
            metrics.record_request("/invocations", "chat", 200, 0.1)
            metrics.record_step(EngineStats(running, 0, running, running, 0, 0))
            os._exit(0)
        os.waitpid(pid, 0)
        pids.append(pid)
    print(metrics.render().decode())
    print("----")
    worker_exited(None, types.SimpleNamespace(pid=pids[0]))
    print(metrics.render().decode())
""")


def test_metrics_from_every_worker_are_merged(tmp_path: Path) -> None:
    environ = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", WORKERS_SCRIPT], cwd=REPO_ROOT, env=environ, capture_output=True,
                            text=True, timeout=60, check=True)
    both, after_exit = result.stdout.split("----")
    assert 'llm_requests_total{route="/invocations",schema="chat",status="200"} 2.0' in both
    assert "llm_running_requests 5.0" in both           # livesum over the two workers
    assert "llm_batch_size_count 2.0" in both
    assert "llm_running_requests 3.0" in after_exit     # the first worker died: its gauge stops counting
    assert 'llm_requests_total{route="/invocations",schema="chat",status="200"} 2.0' in after_exit
