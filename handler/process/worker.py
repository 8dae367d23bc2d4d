"""gunicorn's gthread worker, made so that slow or idle clients cannot hold its request threads.

gunicorn's gthread worker hands each new connection to a pool thread, which reads the request with blocking
``recv`` calls and no deadline: a client that sends one header byte every few seconds, or a body that never comes,
holds a thread for ever, and as many such clients as there are threads stop /ping and every other route.

``DeadlineWorker`` reads each request on the worker's event loop instead, without a thread (``request_reader``),
and only a complete request goes to a pool thread. This module is the worker's life: its start (connection and
file limits, the /ping pool), accepting, handing requests to threads and taking connections back, stopping, and
gunicorn's own errors in our shapes. So pool threads run only requests that have fully arrived, and:

- each request has one read deadline, ``option.request_read_timeout`` seconds from its first byte (from the
  accept for a new connection): a client that has not sent its whole request by then gets a **408** with a JSON
  body and is closed (a new connection that sent nothing is just closed). It is a total: trickling one byte a
  second does not extend it. A kept-alive connection waits for its next request under gunicorn's ``keepalive``
  timeout, and that request's deadline starts with its first byte;
- what a pool thread still reads from the socket (a body with ``Expect: 100-continue``, or beyond the worker's
  buffer budget) is bounded by the same deadline, each ``recv`` getting what is left of it;
- ``GET /ping`` runs on a pool of its own (``PING_THREADS``), so it is answered even while every request thread is
  busy (generations, image fetches);
- a WebSocket upgrade (it has no body, so it is whole at once) runs on a pool of its own too, one thread per open
  WebSocket for its whole life, as many as the worker has connections: it is accepted at once whatever the
  request threads are doing, and WebSockets never take a request thread. The app takes its socket over
  (``take_socket``); the worker writes nothing more on it and forgets it once its thread returns;
- open connections per worker are capped by gunicorn's ``worker_connections`` (``option.max_connections``). At the
  cap a new connection still gets in (a health check, fresh work): it takes the place of the connection that has
  been quiet longest among those not being served (still sending its request, lingering after an error answer, or
  kept alive between requests), which is closed. Stalled and slow-drip clients are the quietest, so past the cap
  they are the ones cut, and /ping is accepted at once instead of waiting in the listen backlog for a read
  deadline to free a place. Only when every connection is being served does the worker stop accepting (one over
  the cap) until one ends;
- a request head over ``MAX_HEAD_BYTES`` is a 431, a request line over gunicorn's ``limit_request_line`` a 414,
  and the errors gunicorn finds itself (malformed request line or header, a header over
  ``limit_request_field_size``, a bad chunk) answer in the server's JSON error shapes instead of gunicorn's HTML:
  OpenAI's ``{"error": {"message", "type", "param", "code"}}`` on ``/v1/*``, the legacy ``{"error",
  "error_type", "param", "code"}`` elsewhere. A client's mistake is logged in one line, without a traceback.

May import: ``handler.process.request_reader``, ``handover`` and gunicorn (the master loads this module: nothing
of the app).
"""

from __future__ import annotations

import errno
import resource
import selectors
import socket
import threading
import time
from concurrent import futures
from functools import partial

from gunicorn import util
from gunicorn.http import errors as http_errors
from gunicorn.workers import gthread

from handler.process.answers import ReadTimeout, describe, error_response
from handler.process.handover import SocketTaken, handing_over_sockets
from handler.process.request_reader import (
    DEFAULT_BODY_BYTES,
    FD_RESERVE,
    MAX_REQUEST_LINE,
    PING_THREADS,
    DeadlineConn,
    RequestReader,
    ScanLimits,
    closing_after_broken_bodies,
)


class DeadlineWorker(gthread.ThreadWorker):
    read_timeout_s = 15.0
    max_body_bytes = DEFAULT_BODY_BYTES

    @classmethod
    def configure(cls, read_timeout_s: float, max_body_bytes: int = DEFAULT_BODY_BYTES) -> type[DeadlineWorker]:
        """This worker class with the server's read timeout and body limit (gunicorn's own settings come through its
        config)."""
        return type(cls.__name__, (cls,), {"read_timeout_s": read_timeout_s, "max_body_bytes": max_body_bytes})

    def __init__(self, *args, **kwargs) -> None:  # in the master, before the fork
        super().__init__(*args, **kwargs)
        self.reader = RequestReader(self, ScanLimits())
        self.ping_pool: futures.ThreadPoolExecutor | None = None
        self.socket_pool: futures.ThreadPoolExecutor | None = None  # WebSockets, each for its connection's life
        self.current = threading.local()          # the path of the request a pool thread is serving
        self._accept_warned = 0.0
        self.connection_cap = self.worker_connections
        self.num_made_room = 0                    # quiet connections closed at the cap, since the last log line
        self._made_room_logged = 0.0

    def init_process(self) -> None:
        line = self.cfg.limit_request_line
        self.reader.limits = ScanLimits(line=line if 0 < line <= MAX_REQUEST_LINE else MAX_REQUEST_LINE,
                                        body=self.max_body_bytes)
        self.ping_pool = futures.ThreadPoolExecutor(max_workers=PING_THREADS, thread_name_prefix="ping")
        self._fit_connections_to_file_limit()
        # gthread stops accepting at worker_connections: one more, so that it accepts at the cap (accept makes room)
        self.connection_cap = self.worker_connections
        self.worker_connections = self.connection_cap + 1
        self.socket_pool = futures.ThreadPoolExecutor(max_workers=self.connection_cap,
                                                      thread_name_prefix="websocket")
        super().init_process()

    def _fit_connections_to_file_limit(self) -> None:
        """Raise the open-file limit to what the connection cap needs (up to the hard limit), else lower the cap:
        an accept failing with EMFILE would leave the listener readable and the event loop spinning."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = self.worker_connections + FD_RESERVE
        if soft == resource.RLIM_INFINITY or soft >= want:
            return
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
        if soft < want:
            self.worker_connections = max(1, soft - FD_RESERVE)
            self.max_keepalived = self.worker_connections - self.cfg.threads
            self.log.warning("open-file limit %d: at most %d connections per worker (option.max_connections)",
                             soft, self.worker_connections)

    def run(self) -> None:
        try:
            super().run()
        finally:
            self.reader.drop_all()
            for pool in (self.ping_pool, self.socket_pool):
                if pool is not None:
                    pool.shutdown(wait=False)

    # ---- event loop: accept; what arrives is the reader's; what a pool thread finished ------------------------
    def accept(self, listener) -> None:
        try:
            client, address = listener.accept()
        except OSError as error:
            if error.errno in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                return
            if error.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                if time.monotonic() - self._accept_warned > 10:
                    self._accept_warned = time.monotonic()
                    self.log.warning("cannot accept a connection: %s (lower option.max_connections)", error)
                return
            raise
        self.nr_conns += 1
        if self.cfg.is_ssl or self.cfg.http2_cleartext != "off":  # not what this server runs: gthread's own way
            conn = gthread.TConn(self.cfg, client, address, listener.getsockname())
            self.enqueue_req(conn)
            return
        conn = DeadlineConn(self.cfg, client, address, listener.getsockname(), self.read_timeout_s)
        self.reader.start(conn, b"")
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.reader.on_readable, conn))
        if self.nr_conns > self.connection_cap:
            self._make_room(conn)

    def _make_room(self, newcomer: DeadlineConn | None) -> None:
        """One over the cap: close the quietest connection not being served, the newcomer excepted (kept-alive ones
        have been quiet since their last answer). None such: the worker stays one over, and gthread stops accepting
        until a connection ends."""
        reading = self.reader.quietest()
        reading = reading if reading is not newcomer else None
        idle = self.keepalived_conns[0] if self.keepalived_conns else None  # the deque is in order of timeout
        if reading is not None and (idle is None or reading.active_at <= idle.timeout - self.cfg.keepalive):
            self.reader.drop(reading)
        elif idle is not None:
            self.keepalived_conns.popleft()
            try:
                self.poller.unregister(idle.sock)
            except (OSError, KeyError, ValueError):
                pass
            self.nr_conns -= 1
            idle.close()
        else:
            return
        self.num_made_room += 1

    def enqueue_req(self, conn: DeadlineConn) -> None:
        pool = self.tpool
        if getattr(conn, "is_ping", False) and self.ping_pool is not None:
            pool = self.ping_pool
        elif getattr(conn, "is_websocket", False) and self.socket_pool is not None:
            pool = self.socket_pool
        future = pool.submit(self.handle, conn)
        future.add_done_callback(lambda fut: self.method_queue.defer(self.finish_request, conn, fut))

    def murder_pending(self) -> None:
        """Each turn of the event loop: kept-alive connections past gunicorn's timeout, and requests past their read
        deadline (``RequestReader.expire``)."""
        super().murder_pending()
        self.reader.expire()
        if self.num_made_room and time.monotonic() - self._made_room_logged >= 10:
            self._made_room_logged = time.monotonic()
            self.log.warning("at the connection cap (option.max_connections=%d): closed %d quiet connections for new "
                             "ones", self.connection_cap, self.num_made_room)
            self.num_made_room = 0

    def _cap_keepalive(self, deadline: float) -> None:
        """Stopping: connections that have not started a request close soon, as kept-alive ones do."""
        super()._cap_keepalive(deadline)
        self.reader.close_idle_by(deadline)

    def finish_request(self, conn: DeadlineConn, fs) -> None:
        """A pool thread is done with a request: keep the connection for the next one, or close it."""
        if not isinstance(conn, DeadlineConn):
            return super().finish_request(conn, fs)
        if conn.taken:  # the app owned the socket and has closed it
            self.reader.drop(conn)
            return
        try:
            keep = fs.result() if not fs.cancelled() else False
        except Exception:
            keep = False
        self._take_back(conn, keep)
        if self.nr_conns > self.connection_cap:  # one over while every connection was served: back to the cap
            self._make_room(None)

    def _take_back(self, conn: DeadlineConn, keep: bool) -> None:
        try:
            if not keep:  # gunicorn lingers on its event loop for up to 2 s here; this worker does not wait
                conn.sock.setblocking(False)
                conn.sock.shutdown(socket.SHUT_WR)
                self.reader.linger(conn)
                self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.reader.on_readable, conn))
                return
            conn.sock.setblocking(False)
            ahead = conn.parser.unreader.take_buffered()  # a pipelined request already read
            if ahead:
                self.reader.start(conn, b"")
                self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.reader.on_readable, conn))
                self.reader.take(conn, ahead)
                return
            conn.set_timeout()
            if not self.alive:
                conn.timeout = min(conn.timeout, time.monotonic() + gthread.STOP_KEEPALIVE_LINGER)
            self.keepalived_conns.append(conn)
            self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.reader.on_readable, conn))
        except Exception:
            self.reader.drop(conn)

    # ---- pool threads ---------------------------------------------------------------------------------------------
    def load_wsgi(self) -> None:
        super().load_wsgi()
        self.wsgi = handing_over_sockets(closing_after_broken_bodies(self.wsgi))

    def handle(self, conn: DeadlineConn):
        """gthread's ``handle`` for an HTTP/1.1 connection whose request the event loop gathered."""
        if not isinstance(conn, DeadlineConn):
            return super().handle(conn)
        self.current.path = conn.path
        req = None
        try:
            conn.sock.setblocking(True)
            conn.init()
            req = next(conn.parser)
            if not req:
                return False
            return self._keepalive_after(conn, self.handle_request(req, conn))
        except SocketTaken:  # a WebSocket's connection, closed by its owner
            conn.taken = True
        except ReadTimeout as error:  # the head was still arriving (a request handed over before it was whole)
            self.handle_error(req, conn.sock, conn.client, error)
        except http_errors.NoMoreData as error:
            self.log.debug("Ignored premature client disconnection. %s", error)
        except StopIteration as error:
            self.log.debug("Closing connection. %s", error)
        except OSError as error:
            if error.errno not in (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN):
                self.log.exception("Socket error processing request.")
            else:
                self.log.debug("Ignoring connection error: %s", error)
        except Exception as error:
            self.handle_error(req, conn.sock, conn.client, error)
        finally:
            self.current.path = ""
        return False

    def handle_error(self, req, client, addr, exc) -> None:
        """gunicorn's error answers, in the server's JSON shapes; a client's mistake is one log line."""
        described = describe(exc)
        path = getattr(req, "path", None) or getattr(self.current, "path", "") or ""
        if described is None:
            self.log.exception("error handling %s", path or "a request")
            described = (500, "Internal Server Error", "internal error; see the server log", "internal_error")
        else:
            self.log.info("refused a request from %s: %d %s", (addr or ("",))[0], described[0], described[2])
        try:
            util.write_nonblock(client, error_response(*described, path))
        except Exception:
            self.log.debug("failed to send an error response")
