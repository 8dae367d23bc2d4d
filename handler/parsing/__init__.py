"""Reading the model's output: tool calls in each chat template's dialect, and reasoning split from the answer.

``dialects`` names how each model family writes a call, ``tool_stream`` reads calls out of text (whole or as it
streams), ``grammars`` writes the llguidance grammar that forces a call, ``reasoning`` splits a reasoning model's
thinking from its answer. The formatters read output through this room, the prompt layer asks it which dialect a
chat template teaches, the protocol layer asks it for forced-call grammars.

May import: ``handler.errors`` and, for the grammars' JSON layout, ``handler.engine.core.json_rules`` and
``handler.engine.core.grammars`` (the engine compiles these grammars, so both must lay JSON out alike). Nothing
above it: not the prompt layer, the wire schemas or the server.
"""
