"""Formatters: token events -> each API's records (``chat``, ``completions``, ``legacy``, ``responses``,
``embeddings``, ``rerank``), each with its context next to it; ``context`` holds what they share, ``framing`` how
records go on the wire (JSON lines, server-sent events). Pure functions of the events and the context an endpoint
fills in.

May import: ``handler.errors``, ``handler.engine.types`` and ``handler.parsing`` (tool calls and reasoning read out
of the text). Not the prompt layer, not ``protocol``: a formatter knows only its context.
"""
