"""Can slow or idle clients starve /ping? Hostile connections against the real server, while /ping is probed.

Starts ``python -m handler serve`` (embedded model) on a free loopback port, then holds for --seconds:
  - --stalled connections that send a request head one byte every --byte-every seconds (slowloris),
  - --idle connections that open and send nothing,
each re-opened as soon as the server closes it (a persistent attacker), while a probe sends ``GET /ping`` on a fresh
connection every --probe-every seconds and counts the answers that are a 200 within --ping-timeout seconds; one
small chat request every 5 s on /invocations is counted the same way (within 30 s). Loopback only, bounded in
connections and time. --busy N keeps N long generations running meanwhile (to fill the request threads: start the
server with fewer threads than that, e.g. --env OPTION_THREADS=4).

    python -m bench.slow_clients [--stalled 200] [--idle 150] [--busy 0] [--seconds 40] [--env OPTION_THREADS=8 ...]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from tests.e2e.conftest import start_server, stop_server

MAX_CONNECTIONS = 2000
HEAD = b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * 4000


class Attackers:
    """Holds ``stalled`` trickling and ``idle`` silent connections open, re-opening any the server closes."""

    def __init__(self, host: str, port: int, stalled: int, idle: int, byte_every: float) -> None:
        self.address = (host, port)
        self.byte_every = byte_every
        self.stop = threading.Event()
        self.reopened = 0
        self.stalled = [self._open() for _ in range(stalled)]
        self.positions = [0] * stalled
        self.idle = [self._open() for _ in range(idle)]

    def _open(self) -> socket.socket | None:
        try:
            sock = socket.create_connection(self.address, timeout=5)
            sock.setblocking(False)
            return sock
        except OSError:
            return None

    def _closed_by_server(self, sock: socket.socket | None) -> bool:
        if sock is None:
            return True
        try:
            sock.recv(65536)  # end of file, or an answer (a 408): either way the server is done with it
            return True
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _renew(self, group: list, index: int) -> None:
        if group[index] is not None:
            group[index].close()
        group[index] = self._open()
        self.reopened += 1

    def run(self) -> None:
        while not self.stop.is_set():
            for i, sock in enumerate(self.stalled):
                if self._closed_by_server(sock):
                    self._renew(self.stalled, i)
                    self.positions[i] = 0
                    continue
                try:
                    sock.send(HEAD[self.positions[i] % len(HEAD):][:1])
                    self.positions[i] += 1
                except OSError:
                    self._renew(self.stalled, i)
                    self.positions[i] = 0
            for i, sock in enumerate(self.idle):
                if self._closed_by_server(sock):
                    self._renew(self.idle, i)
            self.stop.wait(self.byte_every)

    def close(self) -> None:
        self.stop.set()
        for sock in self.stalled + self.idle:
            if sock is not None:
                sock.close()


def keep_busy(url: str, stop: threading.Event) -> None:
    body = {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 400, "ignore_eos": True}
    while not stop.is_set():
        try:
            requests.post(f"{url}/invocations", json=body, timeout=120)
        except requests.RequestException:
            stop.wait(0.5)


def probe(url: str, seconds: float, probe_every: float, ping_timeout: float) -> dict:
    pings = ok_pings = chats = ok_chats = 0
    chat_threads: list[threading.Thread] = []
    chat_ok: list[bool] = []
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}

    def chat() -> None:
        try:
            chat_ok.append(requests.post(f"{url}/invocations", json=body, timeout=30).status_code == 200)
        except requests.RequestException:
            chat_ok.append(False)

    end = time.monotonic() + seconds
    next_chat = time.monotonic()
    while time.monotonic() < end:
        started = time.monotonic()
        if started >= next_chat:
            next_chat = started + 5
            thread = threading.Thread(target=chat, daemon=True)
            thread.start()
            chat_threads.append(thread)
        pings += 1
        try:
            answer = requests.get(f"{url}/ping", timeout=ping_timeout, headers={"Connection": "close"})
            ok_pings += answer.status_code == 200 and time.monotonic() - started <= ping_timeout
        except requests.RequestException:
            pass
        time.sleep(max(0.0, probe_every - (time.monotonic() - started)))
    for thread in chat_threads:
        thread.join(timeout=35)
    chats, ok_chats = len(chat_threads), sum(chat_ok)
    return {"pings": pings, "pings_ok": ok_pings, "chats": chats, "chats_ok": ok_chats}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stalled", type=int, default=200)
    parser.add_argument("--idle", type=int, default=150)
    parser.add_argument("--byte-every", type=float, default=2.0)
    parser.add_argument("--busy", type=int, default=0, help="long generations kept running meanwhile")
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--probe-every", type=float, default=0.5)
    parser.add_argument("--ping-timeout", type=float, default=2.0)
    parser.add_argument("--env", nargs="*", default=[], help="KEY=VALUE settings for the server")
    args = parser.parse_args()
    if args.stalled + args.idle > MAX_CONNECTIONS:
        parser.error(f"at most {MAX_CONNECTIONS} connections")
    env = dict(item.split("=", 1) for item in args.env)
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Path(tmp), env)
        try:
            host, port = server.url.removeprefix("http://").split(":")
            attackers = Attackers(host, int(port), args.stalled, args.idle, args.byte_every)
            thread = threading.Thread(target=attackers.run, daemon=True)
            thread.start()
            busy = threading.Event()
            for _ in range(args.busy):
                threading.Thread(target=keep_busy, args=(server.url, busy), daemon=True).start()
            time.sleep(3)  # let the connections settle in
            result = probe(server.url, args.seconds, args.probe_every, args.ping_timeout)
            busy.set()
            attackers.close()
            thread.join(timeout=10)
            result.update(stalled=args.stalled, idle=args.idle, busy=args.busy, reopened=attackers.reopened, env=env)
        finally:
            stop_server(server)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
