"""The prompt layer: what a request asks for, as the model reads it. The model's tokenizer and chat template
(``renderer``), two texts read together or alone for rerank and score (``pairs``), tools described in the prompt
for templates that do not render them (``tools``) and, for vision-language models, image loading and the vision
tower (``vision``) turn messages into token ids and embeddings.

May import: ``handler.errors``, ``handler.config``, ``handler.engine.types``, ``handler.images`` and
``handler.parsing`` (which dialect a template teaches, which reasoning format it uses). Reading the model's output
back is ``handler.parsing``'s job, not this layer's.
"""
