"""The port while the master downloads the model: every route answers 503 (``/ping`` included), so SageMaker's
health check sees a container that is starting rather than a closed port, and a client gets the reason.

It closes before gunicorn binds the same port (both set ``SO_REUSEADDR``); with port 0 it keeps the port the OS
picked, so the server comes back where the standby was.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from handler.errors import ConfigError


class Standby:
    def __init__(self, host: str, port: int, status: Callable[[], str]) -> None:
        self.host, self.port, self.status = host, port, status

    def __enter__(self) -> Standby:
        status = self.status

        class Answer(BaseHTTPRequestHandler):
            def _busy(self) -> None:
                body = json.dumps({"error": {"message": f"the model is downloading: {status()}",
                                             "type": "service_unavailable", "code": 503}}).encode()
                self.send_response(503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Retry-After", "10")
                self.send_header("Connection", "close")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = _busy  # noqa: N815 (http.server's names)

            def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class's signature)
                return None  # health checks every few seconds would drown the progress lines

        try:
            self.server = ThreadingHTTPServer((self.host, self.port), Answer)
        except OSError as error:
            raise ConfigError(f"cannot listen on {self.host}:{self.port}: {error.strerror}") from None
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, name="standby", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
