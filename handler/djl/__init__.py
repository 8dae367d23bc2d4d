"""A djl-python-style handler contract, so LMI users can bring their ``model.py`` unchanged: the ``handler.djl`` room.

A model directory (or ``option.entryPoint``: a file path, relative to the model directory as in LMI, or a module
name) may provide a module with ``handle(inputs: Input) -> Output | None`` (or ``async def handle``). Then
/invocations goes through it. As in LMI, the first call is an empty initialisation call (``inputs.is_empty()`` is
true; ``inputs.get_properties()`` holds the settings), made once at start before /ping answers 200.
``builtin_handle(inputs)`` runs the built-in handler (both schemas, streaming included), so a user handler can wrap
it. Errors inside the user's handler become a 500 naming the handler; the worker keeps serving. A handler that
cannot be loaded stops the start with one line (``HandlerLoadError``).

``Input`` and ``Output`` carry LMI's own method names and meanings (djl-serving's ``djl_python/inputs.py`` and
``outputs.py``); the ``djl_python`` package at the repository root re-exports them, so ``from djl_python import
Input, Output`` works as it does in LMI.

The built-in engine loads only when the handler asks for it: when its module imports ``builtin_handle`` (or the
``handler.djl`` module), or when ``option.builtin_engine=true``. A handler that runs its own model starts without
loading anything of ours, so it can serve any architecture, or a folder with no ``config.json`` at all.

    from handler.djl import Input, Output, builtin_handle

    def handle(inputs: Input) -> Output | None:
        if inputs.is_empty():
            return None                      # initialisation call
        output = builtin_handle(inputs)
        return Output().add_as_json({"upper": output.get_as_json()["generated_text"].upper()})

The room: ``types`` (``Input``, ``Output``, ``PairList``), ``loading`` (finding, importing and calling the user's
module), ``builtin`` (``builtin_handle``), ``routes`` (``/invocations`` through the user's handler, and the built-in
handler it calls). This package exports what a user's handler imports.

May import: ``handler.config``, ``handler.errors``; ``routes`` also the endpoints' base and ``request_log`` (it is
the route function of ``/invocations`` when a user's handler serves).
"""
from handler.djl.builtin import builtin_handle
from handler.djl.types import Input, Output, PairList

__all__ = ["Input", "Output", "PairList", "builtin_handle"]
