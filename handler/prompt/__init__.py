"""The prompt layer: between the wire schemas (``protocol``) and the engine. The model's tokenizer and chat
template (``renderer``), its tool-call dialect (``tool_calls``) and, for vision-language models, image loading and
the vision tower (``vision``) turn what a request asks for into token ids and embeddings."""
