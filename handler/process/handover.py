"""A connection handed from gunicorn to the app for good: a WebSocket's upgrade request takes its socket
(``take_socket``), and the worker then writes no response on it and forgets it once its thread returns
(``handing_over_sockets`` and ``SocketTaken``, which ``worker`` catches).

May import: nothing of the app (the worker and the server both use it).
"""

from __future__ import annotations

SOCKET_TAKEN = "handler.socket_taken"  # set in a request's environ when the app took its connection over


class SocketTaken(Exception):  # noqa: N818 (not an error: how a taken connection leaves gunicorn's request path)
    """Raised past gunicorn's response writing for a request whose connection the app took over: nothing more is
    written, and the worker forgets the connection (its new owner closes it)."""


def take_socket(environ: dict):
    """Hand a request's connection to the app for good (a WebSocket's upgrade); None where there is none to take
    (a test client). The worker then writes no response for it (``handing_over_sockets``)."""
    sock = environ.get("gunicorn.socket")
    if sock is not None:
        environ[SOCKET_TAKEN] = True
    return sock


def handing_over_sockets(app):
    """WSGI middleware: after a request whose connection the app took (``take_socket``), the app's response is closed
    unsent (its close callbacks run: the request's log line) and ``SocketTaken`` ends gunicorn's handling."""

    def wrapped(environ: dict, start_response):
        result = app(environ, start_response)
        if not environ.get(SOCKET_TAKEN):
            return result
        close = getattr(result, "close", None)
        if close is not None:
            close()
        raise SocketTaken()

    return wrapped
