"""The wire schemas: each API's request as a pydantic model that validates itself (a 400 naming the field), checks
its fields across each other (``check``) and prepares itself for the engine (``prepare``: rendered by the model's
``PromptRenderer``, converted into ``GenerationRequest``s).

May import: ``handler.errors``, ``handler.engine.types``, ``handler.prompt`` (the renderer a request is prepared
with) and ``handler.parsing`` (forced-call grammars). Not ``formatting``: requests and answers never meet.
"""
