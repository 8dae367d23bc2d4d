"""``builtin_handle``: the built-in handler, for a user's ``handle`` to call.

It answers an ``Input`` as the server's own ``/invocations`` answers a request (every schema, streaming included)
and hands back an ``Output``. A user's module imports the function before any server exists, so the worker binds
its built-in handler here when it installs the user's (``handler.djl.routes``): one model per process, as in LMI.

May import: ``handler.djl.types``.
"""

from __future__ import annotations

from collections.abc import Callable

from handler.djl.types import Input, Output

_bound: Callable[[Input], Output] | None = None  # this worker's built-in handler, once its app is built


def builtin_handle(inputs: Input) -> Output:
    """The built-in handler (every schema), for a user's handler to call."""
    if _bound is None:
        raise RuntimeError("the built-in handler is not running in this process")
    return _bound(inputs)


def bind(handle: Callable[[Input], Output]) -> None:
    """Make ``handle`` this process's built-in handler (the worker does, when it installs a user's handler)."""
    global _bound
    _bound = handle
