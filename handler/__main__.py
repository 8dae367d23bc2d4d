"""``python -m handler serve``: validate the settings, then run gunicorn + Flask on the SageMaker port.

SageMaker starts the container with the argument ``serve``. The settings are checked here, in the master,
before any worker starts, so a bad setting ends the start with one line naming it. Each gunicorn worker builds
its own engine (one model per process) in a background thread; the port opens at once and /ping answers 503
until the model is loaded and warmed.

gunicorn's settings come from ``Settings`` (host, port, workers, threads, graceful_timeout, log_level,
worker_timeout), which reads SageMaker's environment names (``config.ENV_NAMES``); this module reads none itself.
The threads of one worker all share the engine's batch.

Metrics: the workers write them to files in ``PROMETHEUS_MULTIPROC_DIR`` so a scrape that reaches any worker sees all
of them. The master makes that folder before forking (prometheus-client picks its mode from the variable when it is
first imported, in the workers) and marks each dead worker so its live gauges stop counting.

May import: anything of the package (it is the entry point); the app itself only inside the worker
(``build_worker_app``), so the master stays light.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from handler.config import Settings
from handler.config_sources import load_settings
from handler.djl.loading import HandlerLoadError, find_entry_point
from handler.download import fetch_model
from handler.errors import ConfigError
from handler.process.heap import give_back, keep_freed_memory, start_trimming
from handler.process.preflight import preflight
from handler.process.worker import DeadlineWorker


def gunicorn_options(settings: Settings) -> dict:
    return {
        "bind": f"{settings.host}:{settings.port}",
        "workers": settings.workers,
        # gthread, reading each request on its event loop under option.request_read_timeout (process/request_reader.py)
        "worker_class": DeadlineWorker.configure(settings.request_read_timeout, settings.max_request_size),
        "worker_connections": settings.max_connections,
        "threads": settings.threads,
        "timeout": settings.worker_timeout,
        "graceful_timeout": settings.graceful_timeout,
        "keepalive": 75,
        "loglevel": settings.log_level,
        "accesslog": None,
        "errorlog": "-",
        "backlog": 2048,
        "child_exit": worker_exited,
        # gunicorn 25+ opens a management socket at one fixed path in $HOME, shared by every server on the machine
        # (tests and benchmarks run several at once); nothing here uses gunicornc
        "control_socket_disable": True,
    }


def prepare_metrics_dir(environ: dict[str, str] | os._Environ) -> Path | None:
    """Point ``PROMETHEUS_MULTIPROC_DIR`` at an empty folder; returns the folder when it made a temporary one.

    A folder the user named is emptied of ``*.db`` files: prometheus-client would add a previous run's counts.
    """
    named = environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not named:
        path = Path(tempfile.mkdtemp(prefix="llm-metrics-"))
        environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
        return path
    Path(named).mkdir(parents=True, exist_ok=True)
    for stale in Path(named).glob("*.db"):
        stale.unlink()
    return None


def prepare_adapter_registry(settings: Settings) -> tuple[Settings, Path | None]:
    """With option.enable_lora: the folder the workers share their adapter registry in (made now, before the fork,
    unless option.adapter_registry_dir names one); returns the folder when it made a temporary one."""
    if not settings.enable_lora or settings.adapter_registry_dir:
        return settings, None
    path = Path(tempfile.mkdtemp(prefix="llm-adapters-"))
    return settings.model_copy(update={"adapter_registry_dir": str(path)}), path


def prepare_sessions_dir(settings: Settings) -> tuple[Settings, Path | None]:
    """With stateful sessions on: the folder the workers share them in (made now, before the fork, unless
    option.sessions_path names one: in /dev/shm when it is writable, as the standards package does); returns the
    folder when it made a temporary one."""
    if not settings.enable_stateful_sessions or settings.sessions_path:
        return settings, None
    shm = Path("/dev/shm")
    parent = shm if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else None
    path = Path(tempfile.mkdtemp(prefix="sagemaker-sessions-", dir=parent))
    return settings.model_copy(update={"sessions_path": str(path)}), path


def prepare_responses_store(settings: Settings) -> tuple[Settings, Path | None]:
    """The folder the workers share stored responses and conversations in, and the key they seal reasoning with (made
    now, before the fork, unless option.responses_store_dir / option.responses_encryption_key name them); returns the
    folder when it made a temporary one."""
    from handler.store.sealing import new_key

    update, made = {}, None
    if not settings.responses_store_dir:
        made = Path(tempfile.mkdtemp(prefix="llm-responses-"))
        update["responses_store_dir"] = str(made)
    if not settings.responses_encryption_key:
        update["responses_encryption_key"] = new_key()
    return settings.model_copy(update=update), made


def worker_exited(server, worker) -> None:
    """gunicorn's ``child_exit`` hook (in the master): a dead worker's live gauges stop counting."""
    from prometheus_client import multiprocess  # the variable is set by now, so the mode is right

    multiprocess.mark_process_dead(worker.pid)


def run_server(settings: Settings, options: dict) -> None:
    from gunicorn.app.base import BaseApplication

    class Application(BaseApplication):
        def load_config(self) -> None:
            for key, value in options.items():
                self.cfg.set(key, value)

        def load(self):
            # finish draining (and flushing the streams ended then) before gunicorn's graceful timeout kills it
            grace_s = max(1.0, options["graceful_timeout"] - 3)
            return build_worker_app(settings, max(1, (os.cpu_count() or 1) // options["workers"]), grace_s)

    Application().run()


def release_load_garbage() -> None:
    """Hand back what loading and warm-up freed (the fp32 weights int8 replaced, the warm-up's KV cache), then keep
    handing back what traffic frees (``handler.process.heap``)."""
    give_back()
    start_trimming()


def stop_on_load_failure(reason: str) -> None:
    """A model that failed to load never will: say why in one line and exit with gunicorn's boot-error code, which
    stops the whole server (exit 3) instead of answering /ping with 503 for ever."""
    print(f"error: the model failed to load: {reason}", file=sys.stderr, flush=True)
    os._exit(3)  # gunicorn.arbiter.Arbiter.WORKER_BOOT_ERROR


STOPPED_MESSAGE = "the server is stopping (SIGTERM) and this request did not finish within its grace period"


def handler_load_failure(error: Exception) -> Exception:
    """A user's handler that cannot load (or settings the worker refuses): gunicorn's ``AppImportError`` prints its
    message as one line, logs the traceback only at debug level (option.log_level=debug), and stops the master with
    exit 4 ("App failed to load") instead of retrying the worker."""
    from gunicorn.errors import AppImportError

    return AppImportError(f"error: {error}")


def build_worker_app(settings: Settings, num_threads: int, grace_s: float):
    """Runs in each worker after the fork: start the engine loading and return the WSGI app."""
    from handler.process.lifecycle import Drain
    from handler.server import create_app
    from handler.service import ModelService

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keep_freed_memory()
    try:
        service = ModelService(settings, num_threads=num_threads, on_loaded=release_load_garbage,
                               on_load_failed=stop_on_load_failure)
    except (HandlerLoadError, ConfigError) as error:
        raise handler_load_failure(error) from error
    drain = Drain(grace_s, service.engine.stop, STOPPED_MESSAGE)
    drain.install()  # after gunicorn's own handlers, which it chains to
    service.start()
    app = create_app(service, drain.draining.is_set, drain.count)  # background responses count as in flight
    app.wsgi_app = drain.wrap(app.wsgi_app)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m handler")
    parser.add_argument("command", choices=["serve"], help="SageMaker starts containers with 'serve'")
    parser.add_argument("--host", help="the address to bind (default: option.host, SERVER_HOST, 0.0.0.0)")
    args = parser.parse_args(argv)
    try:
        settings = load_settings()
        if args.host:
            settings = settings.model_copy(update={"host": args.host})
        settings = fetch_model(settings)  # a Hub id or an s3:// prefix: downloaded now, /ping 503 meanwhile
        # a user's model.py may serve it (a named .py that is not there stops the start here)
        if find_entry_point(settings.model_dir, settings.entryPoint) is None:
            preflight(settings)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    made_dir, master_pid = prepare_metrics_dir(os.environ), os.getpid()  # before gunicorn forks any worker
    settings, registry_dir = prepare_adapter_registry(settings)
    settings, sessions_dir = prepare_sessions_dir(settings)
    settings, store_dir = prepare_responses_store(settings)
    try:
        run_server(settings, gunicorn_options(settings))
    finally:  # a worker's SystemExit comes through here too: only the master removes the folders
        for made in (made_dir, registry_dir, sessions_dir, store_dir):
            if made is not None and os.getpid() == master_pid:
                shutil.rmtree(made, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
