"""Chat prompts for vision-language models: image references -> RGB images -> the model's processor and vision
tower -> token ids plus the image embeddings the engine puts at the image tokens' positions (the lean engine); or
-> the model's processor -> token ids plus the images themselves, which a backend with its own vision tower (vLLM)
encodes.

Images are fetched (SSRF rules in ``handler.images.policy``; a request's URLs at once, within its fetch budget and
the worker's fetch cap, ``handler.images.loader``), decoded (total pixels and the worker's image memory checked
first) and encoded on the request's own thread, so a slow URL or a large image never holds up the engine's batch;
the encoded prompt then joins the batch like any other. Every failure names the message and part it came from
(``messages[i].content[j]``) or the setting that refused it.
"""

from __future__ import annotations

from handler import metrics
from handler.config import Settings
from handler.errors import BadRequest
from handler.images import DecodeLimits, FetchPolicy, ImageLoader, LoadBudget, LoadObserver
from handler.prompt.renderer import ImageRef, PromptRenderer, RenderedPrompt


class _Metrics(LoadObserver):
    def fetch_failed(self, reason: str) -> None:
        metrics.record_image_fetch_failure(reason)

    def waited(self, resource: str) -> None:
        metrics.record_image_wait(resource)

    def refused(self, reason: str) -> None:
        metrics.record_image_rejection(reason)


def image_loader(settings: Settings) -> ImageLoader:
    """This worker's image loader: the settings' fetch policy, per-image limits and budgets; reports to metrics."""
    policy = FetchPolicy(enabled=settings.image_fetch_enabled, allowed_hosts=settings.image_fetch_allowed_hosts,
                         timeout_s=settings.image_fetch_timeout, max_bytes=settings.image_max_bytes)
    limits = DecodeLimits(max_pixels=settings.image_max_pixels, max_bytes=settings.image_max_bytes)
    budget = LoadBudget(fetch_budget_s=settings.image_fetch_budget, fetch_concurrency=settings.image_fetch_concurrency,
                        max_total_pixels=settings.image_max_total_pixels, memory_budget=settings.image_memory_budget,
                        wait_timeout_s=settings.image_wait_timeout, request_timeout_s=settings.request_timeout)
    return ImageLoader(policy, limits, budget, observer=_Metrics())


class VisionRenderer(PromptRenderer):
    """A ``PromptRenderer`` for a vision-language model: prompts go through the model's processor (its chat
    template and image-token expansion), with or without images. ``encoder`` is ``engine.model.vision.VisionEncoder``
    (images become embeddings here) or ``ImageProcessor`` (the decoded images go on to the backend)."""

    def __init__(self, tokenizer, tool_format: str, encoder, images: ImageLoader, max_images: int,
                 reasoning_parser: str = "auto") -> None:
        super().__init__(tokenizer, tool_format, reasoning_parser)
        self.encoder = encoder
        self._images = images
        self._max_images = max_images
        self.has_chat_template = bool(getattr(encoder.processor, "chat_template", None)) or self.has_chat_template

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    template_kwargs: dict | None = None) -> list[int]:
        return list(self.render_prompt(messages, tools, template_kwargs=template_kwargs).prompt_ids)

    def render_prompt(self, messages: list[dict], tools: list[dict] | None = None,
                      images: list[ImageRef] | None = None, arrived_at: float | None = None,
                      template_kwargs: dict | None = None) -> RenderedPrompt:
        if template_kwargs:  # the processor renders its own template and takes no variables from here
            raise BadRequest("chat_template_kwargs and reasoning_effort are not available for vision models",
                             param="chat_template_kwargs")
        images = images or []
        if len(images) > self._max_images:
            raise BadRequest(f"the request has {len(images)} images; at most {self._max_images} are allowed "
                             "(option.max_images_per_request)", param=images[self._max_images].param)
        messages = [_as_parts(m) for m in self.with_tools(messages, tools or [])]
        # the decoded images hold their share of option.image_memory_budget until encoded here (or, for vLLM, until
        # its processor takes the copies the request carries on)
        with self._images.load(images, started_at=arrived_at) as pictures:
            try:
                # detail "low" applies when every image asks for it: the processor takes one setting per call
                encoded = self.encoder.encode(messages, pictures, low_detail=all(r.detail == "low" for r in images))
            except ValueError as error:
                raise BadRequest(f"the images could not be encoded for this model: {error}",
                                 param="messages") from None
        return RenderedPrompt(tuple(encoded.prompt_ids), encoded.embeds, encoded.images)


def _as_parts(message: dict) -> dict:
    """Vision templates iterate over content parts: a plain string becomes one text part."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": [{"type": "text", "text": content}]}
    return message
