"""S3 on loopback: moto's server mode, a real HTTP endpoint that boto3 reaches unchanged through
``AWS_ENDPOINT_URL_S3``, and a TCP proxy in front of it that can cut a connection mid-body or slow it down (a
connection lost mid-shard; a download long enough to watch or to interrupt)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class S3StandIn:
    """moto's S3 behind ``Proxy``; ``env`` is what a process needs to reach it with its default credentials chain."""

    def __enter__(self) -> S3StandIn:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request would bury the output
        self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.moto.start()
        self.proxy = Proxy(self.moto.get_host_and_port()[1]).__enter__()
        self.env = {**CREDENTIALS, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{self.proxy.port}"}
        return self

    def __exit__(self, *exc) -> None:
        self.proxy.__exit__()
        self.moto.stop()

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.moto.get_host_and_port()[1]}",
                            region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing")

    def upload(self, bucket: str, prefix: str, folder: Path) -> None:
        client = self.client()
        if bucket not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
            client.create_bucket(Bucket=bucket)
        for path in sorted(folder.iterdir()):
            client.upload_file(str(path), bucket, f"{prefix}/{path.name}")


class Proxy:
    """Forwards loopback TCP to ``upstream_port``. ``cut_after``: the next connection whose answer passes that
    many bytes is closed there (once). ``bytes_per_s``: answers are sent no faster. ``answered`` counts bytes."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.cut_after: int | None = None
        self.bytes_per_s: float | None = None
        self.answered = 0
        self.cuts = 0

    def __enter__(self) -> Proxy:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        sent = 0
        try:
            while data := source.recv(65536):
                if answers and self.bytes_per_s:
                    time.sleep(len(data) / self.bytes_per_s)
                if answers and self.cut_after is not None and sent + len(data) > self.cut_after:
                    keep, self.cut_after, self.cuts = self.cut_after - sent, None, self.cuts + 1
                    sink.sendall(data[:keep])
                    break
                sink.sendall(data)
                sent += len(data)
                if answers:
                    self.answered += len(data)
        except OSError:
            pass
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            end.close()
