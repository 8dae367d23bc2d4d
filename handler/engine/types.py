"""Everything that crosses the engine boundary.

Parsers build a ``GenerationRequest``; the engine answers with a stream of ``TokenEvent``s; formatters fold or
frame those events. Nothing here knows about HTTP or a wire schema, and nothing here imports torch.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field

MIN_SAMPLING_TEMPERATURE = 1e-5


class FinishReason(enum.Enum):
    """Why a choice ended. Each schema's formatter picks its own wire string."""

    EOS = "eos"              # the model emitted an end-of-sequence token
    STOP = "stop"            # a stop string or stop token id matched
    LENGTH = "length"        # max_new_tokens or the context limit
    DEADLINE = "deadline"    # option.request_timeout passed after tokens were generated: the answer is what came
                             # before it (the wire says "length", as for max_tokens: a budget ran out)
    ABORT = "abort"          # the client went away or the server is shutting down
    ERROR = "error"          # this request failed; the message and its ``ErrorKind`` are on the event


class ErrorKind(enum.Enum):
    """What kind of failure ended a choice with ``FinishReason.ERROR`` (the server picks the status from it)."""

    TIMEOUT = "timeout"      # the request ran past option.request_timeout (504)
    MODEL = "model"          # the model, the sampler or the grammar failed on this request (500)
    STOPPED = "stopped"      # the engine thread is gone (500)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next token is chosen. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0                      # 0: no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0     # HF-style: divides positive logits of tokens seen in prompt or output
    frequency_penalty: float = 0.0      # OpenAI-style: minus penalty * count in the output
    presence_penalty: float = 0.0       # OpenAI-style: minus penalty once a token is in the output
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None

    @property
    def is_greedy(self) -> bool:
        # Below this, dividing fp32 logits by the temperature overflows; the distribution is an argmax anyway.
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def needs_truncation(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


@dataclass(frozen=True, slots=True)
class StopConditions:
    """When a choice ends, besides the model's own end-of-sequence token."""

    max_new_tokens: int | None = None   # None: up to the context limit
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # before this many tokens, EOS and stop_token_ids cannot be sampled and stop strings do not count (min_tokens)
    min_new_tokens: int = 0
    # the stop string, stop token or EOS that ended the choice is part of its text (vLLM's
    # include_stop_str_in_output); otherwise the text ends before it
    include_stop_str_in_output: bool = False


@dataclass(frozen=True, slots=True)
class BeamParams:
    """Beam search (transformers' ``generate(num_beams=...)`` rule, ``core.beam``): ``width`` beams, the request's
    ``n`` best hypotheses returned."""

    width: int
    length_penalty: float = 1.0         # a hypothesis scores sum(logprobs) / length ** length_penalty
    early_stopping: bool | str = False  # True, False or "never" (transformers' meanings)
    param: str = "best_of"              # the request field that set the width, for error messages
    groups: int = 1                     # diverse beam search: this many groups of width / groups beams
    diversity_penalty: float = 0.0      # what a group's candidate loses per earlier group's same token this step


@dataclass(frozen=True, slots=True)
class SpeculationParams:
    """A request's own speculative decoding (the OVMS reference's fields): how many tokens to draft a step, or
    (a draft model only) draft while the draft's top token is at least this likely."""

    num_tokens: int | None = None       # num_assistant_tokens
    confidence: float | None = None     # assistant_confidence_threshold
    param: str = "num_assistant_tokens"


@dataclass(frozen=True, slots=True)
class TextOptions:
    """How output tokens become text (vLLM's names)."""

    skip_special_tokens: bool = True            # special tokens' text left out (keep_special_ids excepted)
    # with special tokens' text kept: a space between each one and the text beside it (transformers' slow
    # tokenizers' rule); False: the tokenizer's own decoding, which adds none
    spaces_between_special_tokens: bool = False


@dataclass(frozen=True, slots=True)
class ReasoningGate:
    """A thinking model's reasoning comes before a constrained answer. ``think``: free text from ``start`` (already
    in the prompt when ``opened``; else optional) up to ``end``, then the grammar. ``harmony`` (gpt-oss): any number
    of whole ``analysis`` / ``commentary`` messages, then the grammar as the ``final`` channel's message (``start``
    and ``end`` unused: the channels are special tokens)."""

    start: str
    end: str
    opened: bool
    style: str = "think"  # think | harmony


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on the output: every choice is a sentence of this grammar (constrained decoding)."""

    # "json_schema" (source: the schema as JSON text), "lark" (llguidance's Lark dialect), "regex", "choice" (source:
    # a JSON list of strings) or "grammar" (Lark or llama.cpp's GBNF); ``core.grammars`` reads each
    kind: str
    source: str
    param: str       # the request field it came from, for error messages
    after_reasoning: ReasoningGate | None = None  # the grammar starts once the model's reasoning has ended


@dataclass(frozen=True, slots=True)
class PromptEmbeds:
    """Input embeddings that replace the token embeddings at some prompt positions: a vision model's image
    features at its image-token positions."""

    positions: tuple[int, ...]       # ascending
    values: object                   # torch.Tensor [len(positions), hidden], in the model's dtype

    def in_chunk(self, start: int, length: int) -> tuple[list[int], object]:
        """The embeddings of prompt positions ``[start, start + length)`` (one prefill chunk; an image may span
        chunks): their offsets from ``start`` and their values ``[k, hidden]``."""
        first = bisect.bisect_left(self.positions, start)
        end = bisect.bisect_left(self.positions, start + length)
        return [p - start for p in self.positions[first:end]], self.values[first:end]


@dataclass(frozen=True, slots=True)
class PromptImages:
    """A prompt's images for a backend that runs the model's vision tower itself: the prompt as the processor takes
    it, one placeholder token per image (``GenerationRequest.prompt_ids`` holds the same prompt with the
    placeholders expanded, as the model sees it), the decoded images in order, and the processor options the
    request asked for (OpenAI's ``detail: "low"``), for vLLM, which runs the processor again; or, for the
    transformers path, the processor's outputs themselves (``inputs``: pixel values and the family's other inputs,
    the images then left out)."""

    placeholder_ids: tuple[int, ...]
    images: tuple[object, ...]                          # PIL.Image.Image, RGB
    processor_kwargs: tuple[tuple[str, object], ...] = ()
    inputs: dict | None = None                          # name -> torch.Tensor, besides input_ids / attention_mask


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One prompt to complete, ``n`` times, with everything the engine needs to do it."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: StopConditions = field(default_factory=StopConditions)
    n: int = 1                          # choices returned (with beam search: the best n of beam.width beams)
    beam: BeamParams | None = None      # beam search instead of sampling (greedy only, not streamed)
    speculation: SpeculationParams | None = None  # the request's own drafting (None: the server's settings)
    num_top_logprobs: int = 0           # 0: none; the chosen token's logprob is always reported
    # the prompt's own logprobs (echo with logprobs, vLLM's prompt_logprobs, TGI's decoder_input_details): None not
    # asked; k the k most likely alternatives at each prompt position besides the prompt's token (0: that token only)
    prompt_logprobs: int | None = None
    truncate_prompt: bool = False       # too long for the context: keep the prompt's last tokens instead of refusing
    grammar: GrammarSpec | None = None  # constrained decoding (response_format, forced tool calls)
    prompt_embeds: PromptEmbeds | None = None   # the lean engine's image features, from our vision tower
    prompt_images: PromptImages | None = None   # the images themselves, for a backend with its own tower (vLLM)
    keep_special_ids: tuple[int, ...] = ()  # special tokens whose text stays in the output (tool-call markers)
    text: TextOptions = field(default_factory=TextOptions)
    prompt_param: str = "prompt"        # the request field the prompt came from, named by errors about it
    adapter: str | None = None          # the LoRA adapter to generate with (None: the base model)
    adapter_param: str = "adapter"      # where the request named it (a header or a field), for errors
    # time.monotonic() when the request arrived (before its prompt was rendered: image fetches included); its
    # deadline counts from here. None: from submit
    arrived_at: float | None = None
    # the order of admission and prefill among waiting work: lower first (vLLM's meaning); None: not asked, 0
    priority: int | None = None
    session: SessionRef | None = None   # a stateful session whose prompt blocks the prefix cache keeps


@dataclass(frozen=True, slots=True)
class SessionRef:
    """A stateful session a request belongs to: the engine keeps the KV of its prompts' whole blocks (pinned in the
    prefix cache) until the session ends (``EngineBackend.end_session``) or ``expires_at`` (``time.monotonic()``)
    passes, within the KV budget."""

    session_id: str
    expires_at: float


@dataclass(frozen=True, slots=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """One prompt token and how likely the model found it after the tokens before it. The first prompt token has
    no context: its ``logprob`` and ``rank`` are None and it has no alternatives."""

    token_id: int
    logprob: float | None
    rank: int | None = None             # its place in the vocabulary, most likely first (1: the most likely; vLLM)
    top_logprobs: tuple[TopLogprob, ...] = ()  # the most likely tokens at this position, most likely first
    is_special: bool = False


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One step of one choice: a token and the text it released, or the choice's end.

    ``text`` is the text this event makes final; it can be empty while a possible stop string or an unfinished
    UTF-8 character is held back, and the held text arrives with a later event. Joined in order, the ``text`` of a
    choice's events is exactly its completion. The last event of a choice has ``finish_reason`` set; it may carry
    a token too (the token that ended it) or none (``token_id is None``).
    """

    index: int                          # which choice (0..n-1)
    token_id: int | None
    text: str
    logprob: float | None = None
    top_logprobs: tuple[TopLogprob, ...] = ()
    is_special: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None  # set with ``error``
    num_prompt_tokens: int = 0          # set on final events, for usage
    num_generated_tokens: int = 0       # set on final events: tokens this choice generated
    # the whole prompt's logprobs (one per prompt token, the first without one), on each choice's first token event
    # when the request asked for them (``GenerationRequest.prompt_logprobs``)
    prompt_logprobs: tuple[PromptLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptParts:
    """What the prompt layer needs from a load: the transformers tokenizer (chat template) and, for a
    vision-language model, its vision encoder. The engine never reads them."""

    tokenizer: object
    vision: object | None = None      # model.vision.VisionEncoder (lean), ImageProcessor (transformers path, vLLM)


@dataclass(frozen=True, slots=True)
class Pooling:
    """How a model's token states become one embedding: ``mean`` over the input's tokens, the first token's
    (``cls``) or the last token's (``last``), then scaled to unit length when ``normalize``."""

    mode: str = "last"                # "mean" | "cls" | "last"
    normalize: bool = True
    source: str = "default"           # where it was read: sentence-transformers' config, or the default


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """Token ids to embed (one tuple an input, special tokens already added); answered in order, all or none."""

    request_id: str
    inputs: tuple[tuple[int, ...], ...]
    arrived_at: float = 0.0
    param: str = "input"              # the request field the inputs came from, for errors


@dataclass(frozen=True, slots=True)
class Embeddings:
    """The answer to an ``EmbeddingRequest``: one vector an input (``[len(inputs), dimensions]`` fp32 values as
    lists), and the tokens they took."""

    vectors: tuple[tuple[float, ...], ...]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class TokenPair:
    """Two texts as a cross-encoder reads them together: the pair's token ids (the tokenizer's special tokens and
    separators in), and where the second text's segment starts (token type 1 from there, for a model with token
    types; ``len(ids)`` when the tokenizer gives none). ``len`` is its tokens, as an embedding input's."""

    ids: tuple[int, ...]
    second_start: int

    def __len__(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """Pairs for a cross-encoder to score, one score each, answered in order, all or none. ``raw``: the logits as
    they are, without the activation the checkpoint names (TEI's ``raw_scores``, vLLM's ``use_activation``)."""

    request_id: str
    inputs: tuple[TokenPair, ...]
    arrived_at: float = 0.0
    param: str = "documents"          # the request field the pairs' second texts came from, for errors
    raw: bool = False


@dataclass(frozen=True, slots=True)
class Scores:
    """The answer to a ``ScoreRequest``: one score a pair, and the tokens they took."""

    values: tuple[float, ...]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """A registered LoRA adapter, as ``GET /adapters`` lists it."""

    name: str
    src: str
    pinned: bool = False
    loaded: bool = False            # its weights are in memory now (at most option.max_loras are)
    rank: int | None = None         # known once loaded
    targets: tuple[str, ...] = ()   # the PEFT modules it changes, once loaded
