"""What the schemas share: validation errors that name the field, the ``extra-parameters`` policy for fields a
schema does not declare, the OpenAI sampling fields' conversion, and request ids.

``extra-parameters`` (Azure ML's request header) decides what happens to undeclared top-level fields (and, for the
legacy schema, undeclared keys of ``parameters``):

- ``error`` (the default, as Azure documents): a 400 naming the field.
- ``ignore`` (``drop`` is an alias): the fields are dropped and named in ``Extras.ignored``; the server returns them
  in the ``extra-parameters-ignored`` response header, so nothing is dropped silently.
- ``pass-through``: the fields go to the engine's generation parameters when the engine has one of that name
  (``PassThrough``: the LMI / TGI names ``max_new_tokens``, ``do_sample``, ``stop_sequences``);
  any other is a 422 naming it (the model cannot serve it).
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from typing import Annotated, Literal, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from handler.engine.types import (
    BeamParams,
    GenerationRequest,
    GrammarSpec,
    SamplingParams,
    SpeculationParams,
    StopConditions,
    TextOptions,
)
from handler.errors import BadRequest, Unprocessable
from handler.protocol.attributes import CUSTOM_ATTRIBUTES_HEADER

Model = TypeVar("Model", bound=BaseModel)
EXTRA_PARAMETERS_HEADER = "extra-parameters"


def parse_model(model: type[Model], body: object, prefix: str = "") -> Model:
    """Validate a JSON body; a failure becomes a 400 naming the first offending field and why."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", param=None)
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = max(error.errors(), key=lambda e: len(e["loc"]))  # the most specific of a union's attempts
        field = prefix + field_path(first["loc"])
        discriminator = str(first.get("ctx", {}).get("discriminator", ""))
        if first["type"] == "union_tag_invalid" and discriminator.startswith("'"):  # a tag no member takes: name
            field += "." + discriminator.strip("'")                                   # its field (tools[4].type)
        if first["type"] == "extra_forbidden":
            raise BadRequest(f"unknown field '{field}': this server does not support it", param=field) from None
        raise BadRequest(f"invalid '{field}': {first['msg']}", param=field or None) from None


def field_path(loc: tuple) -> str:
    """``("messages", 0, "content", "list[...]", 1, "image_url", "image_url", "detail")`` ->
    ``messages[0].content[1].image_url.detail``: pydantic's union-member tags dropped, field names kept."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif not _is_union_tag(item) and (not parts or parts[-1] != f".{item}"):
            parts.append(f".{item}")
    return "".join(parts).lstrip(".")


def _is_union_tag(item: str) -> bool:
    """A union member's tag: a type's name (``str``, ``list[...]``, a model class's ``RerankDocument``: the wire's
    field names are all lower case), or a validator's."""
    return ("[" in item or item.startswith("function-") or item in {"str", "int", "float", "bool", "none"}
            or item[:1].isupper())


class ExtraParameters(enum.Enum):
    """The ``extra-parameters`` header's policies (see the module docstring)."""

    ERROR = "error"
    IGNORE = "ignore"
    PASS_THROUGH = "pass-through"

    @classmethod
    def from_header(cls, value: str | None) -> ExtraParameters:
        """The policy a header value names; absent means ``error``; anything unknown is a 400 naming the header."""
        return cls.ERROR if value is None else cls._named(value, EXTRA_PARAMETERS_HEADER)

    @classmethod
    def for_request(cls, header: str | None, attribute: str | None, default: str) -> ExtraParameters:
        """The request's policy: the ``extra-parameters`` header, else ``extra-parameters=...`` among SageMaker's
        custom attributes (``attribute``: its value, ``attributes.RequestProperties``), else the deployment's
        ``option.extra_parameters``."""
        if header is not None:
            return cls._named(header, EXTRA_PARAMETERS_HEADER)
        if attribute is not None:
            return cls._named(attribute, CUSTOM_ATTRIBUTES_HEADER)
        return cls(default)

    @classmethod
    def _named(cls, value: str, where: str) -> ExtraParameters:
        name = value.strip().lower()
        if name == "drop":
            return cls.IGNORE
        try:
            return cls(name)
        except ValueError:
            raise BadRequest(f"invalid extra-parameters {value!r} in {where}: use error, ignore (or drop) or "
                             "pass-through", param=where) from None


class PassThrough(BaseModel):
    """Generation parameters the engine has under their LMI / TGI names, taken from undeclared fields under
    ``extra-parameters: pass-through``; each one given replaces (limits, sampling) or extends (stops) the request's."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_new_tokens: int | None = Field(None, ge=1)
    do_sample: bool | None = None
    stop_sequences: list[str] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _no_empty_stop(cls, stops: list[str] | None) -> list[str] | None:
        if stops and any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    def apply(self, generation: GenerationRequest) -> GenerationRequest:
        stop = dataclasses.replace(
            generation.stop, max_new_tokens=self.max_new_tokens or generation.stop.max_new_tokens,
            stop_strings=generation.stop.stop_strings + tuple(self.stop_sequences or ()))
        sampling = generation.sampling
        if self.do_sample is not None:  # HF generate: do_sample false is greedy; true samples, at 1.0 unless given
            temperature = (1.0 if sampling.is_greedy else sampling.temperature) if self.do_sample else 0.0
            sampling = dataclasses.replace(sampling, temperature=temperature)
        return dataclasses.replace(generation, stop=stop, sampling=sampling)


@dataclasses.dataclass(frozen=True, slots=True)
class Extras:
    """What ``parse_request`` did with undeclared fields: the names it dropped, the parameters it passes on."""

    ignored: tuple[str, ...] = ()
    passed: PassThrough | None = None

    def apply(self, generation: GenerationRequest) -> GenerationRequest:
        return generation if self.passed is None else self.passed.apply(generation)


def parse_request(model: type[Model], body: object, policy: ExtraParameters) -> tuple[Model, Extras]:
    """Validate a request body under an ``extra-parameters`` policy. Undeclared fields are looked for at the top
    level and inside the fields a model names in its ``extra_parameters_in`` class attribute."""
    if policy is ExtraParameters.ERROR or not isinstance(body, dict):
        return parse_model(model, body), Extras()
    declared, undeclared = split_undeclared(model, body)
    if policy is ExtraParameters.IGNORE:
        names = tuple(prefix + name for prefix, fields in undeclared.items() for name in fields)
        return parse_model(model, declared), Extras(ignored=names)
    passed = PassThrough()
    for prefix, fields in undeclared.items():
        for name in fields:
            if name not in PassThrough.model_fields:
                raise Unprocessable(f"unknown field '{prefix}{name}': the model cannot serve it (extra-parameters: "
                                    f"pass-through passes on only {', '.join(PassThrough.model_fields)})",
                                    param=prefix + name)
        update = parse_model(PassThrough, fields, prefix).model_dump(exclude_unset=True)
        passed = passed.model_copy(update=update)
    return parse_model(model, declared), Extras(passed=passed)


def split_undeclared(model: type[BaseModel], body: dict, prefix: str = "") -> tuple[dict, dict[str, dict]]:
    """``body`` without the fields ``model`` does not declare, and those fields keyed by where they were
    (``""`` for the top level, ``"parameters."`` inside legacy's ``parameters``)."""
    declared = {key: value for key, value in body.items() if key in model.model_fields}
    undeclared = {prefix: {key: value for key, value in body.items() if key not in model.model_fields}}
    for name in getattr(model, "extra_parameters_in", ()):
        inner = model.model_fields[name].annotation
        if isinstance(declared.get(name), dict) and isinstance(inner, type) and issubclass(inner, BaseModel):
            declared[name], nested = split_undeclared(inner, declared[name], f"{prefix}{name}.")
            undeclared.update(nested)
    return declared, {where: fields for where, fields in undeclared.items() if fields}


class OpenAISampling(Protocol):
    """The OpenAI sampling fields (and the vLLM extensions) chat and completions requests share."""

    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    repetition_penalty: float | None
    frequency_penalty: float
    presence_penalty: float
    logit_bias: dict[int, float] | None
    seed: int | None


def openai_sampling_params(request: OpenAISampling, default_temperature: float) -> SamplingParams:
    # Without a temperature: the model's own default (generation_config.json), greedy when it has none (as
    # LMI and HF generate do; OpenAI's hosted default of 1.0 would make small models ramble).
    temperature = default_temperature if request.temperature is None else request.temperature
    return SamplingParams(
        temperature=temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=0 if request.top_k in (None, -1) else request.top_k,
        min_p=request.min_p or 0.0,
        repetition_penalty=request.repetition_penalty or 1.0,
        frequency_penalty=request.frequency_penalty,
        presence_penalty=request.presence_penalty,
        logit_bias=tuple(sorted((request.logit_bias or {}).items())),
        seed=request.seed,
    )


def check_stop(stop: str | list[str] | None) -> None:
    if isinstance(stop, list) and len(stop) > 4:
        raise BadRequest(f"stop has {len(stop)} sequences; at most 4 are allowed", param="stop")
    if any(s == "" for s in stop_list(stop)):
        raise BadRequest("stop sequences must not be empty", param="stop")


def check_logit_bias(bias: dict[int, float] | None) -> None:
    for token_id, value in (bias or {}).items():
        if not -100.0 <= value <= 100.0:
            raise BadRequest(f"logit_bias[{token_id}]={value} is outside -100..100", param="logit_bias")


def check_best_of(best_of: int | None, n: int, stream: bool) -> None:
    """vLLM / OpenAI: best_of candidates are generated and the n best returned, so it needs best_of >= n and
    cannot stream (the best are known only at the end)."""
    if best_of is None:
        return
    if best_of < n:
        raise BadRequest(f"best_of={best_of} is less than n={n}; it must be at least n", param="best_of")
    if stream:
        raise BadRequest("best_of cannot be used with stream: true", param="best_of")


class StopAndTextFields(BaseModel):
    """vLLM's fields for where a choice ends and how its tokens become text, shared by every schema (the legacy
    schema also takes ``min_new_tokens``, HF ``generate``'s name)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool | None = None  # see TextOptions: only an explicit true adds spaces

    def stop_conditions(self, max_new_tokens: int | None, stop_strings: tuple[str, ...], ignore_eos: bool,
                        min_new_tokens: int | None = None) -> StopConditions:
        return StopConditions(max_new_tokens=max_new_tokens, stop_strings=stop_strings,
                              stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=ignore_eos,
                              min_new_tokens=self.min_tokens if min_new_tokens is None else min_new_tokens,
                              include_stop_str_in_output=self.include_stop_str_in_output)

    def text_options(self) -> TextOptions:
        return TextOptions(skip_special_tokens=self.skip_special_tokens,
                           spaces_between_special_tokens=bool(self.spaces_between_special_tokens))


def check_min_tokens(min_tokens: int, max_tokens: int | None, param: str = "min_tokens",
                     max_param: str = "max_tokens") -> None:
    """vLLM's rule: the minimum cannot be above the maximum."""
    if max_tokens is not None and min_tokens > max_tokens:
        raise BadRequest(f"{param}={min_tokens} is more than {max_param}={max_tokens}", param=param)


@dataclasses.dataclass(frozen=True, slots=True)
class BeamAsk:
    """What a request says about beam search, in any schema's names (``plan_beams`` decides)."""

    asked: bool                      # use_beam_search, or legacy num_beams > 1
    width: int                       # best_of, else n (legacy: num_beams)
    best_of: int | None
    length_penalty: float
    early_stopping: bool | str
    fields_set: frozenset[str]       # the beam fields the request gave (to refuse them without beam search)
    param: str                       # the field that asks for it, named by errors
    diversity_penalty: float | None = None  # diverse beam search (groups: one beam each unless ``groups``)
    groups: int | None = None        # legacy num_beam_groups


class BeamFields(BaseModel):
    """vLLM's beam-search fields (chat and completions); ``best_of`` with sampling off is beam search too."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0)
    early_stopping: bool | Literal["never"] = False
    diversity_penalty: float | None = Field(None, ge=0.0, le=100.0)  # OVMS: diverse beam search, a group a beam

    def beam_ask(self, best_of: int | None, n: int) -> BeamAsk:
        return BeamAsk(self.use_beam_search, best_of or n, best_of, self.length_penalty, self.early_stopping,
                       frozenset(self.model_fields_set & BEAM_ONLY), "use_beam_search", self.diversity_penalty)


class SpeculationFields(BaseModel):
    """The OVMS reference's speculative-decoding fields (chat and completions): how many tokens the draft proposes
    a step, or the confidence below which it stops proposing (a draft model only); one or the other."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    num_assistant_tokens: int | None = Field(None, ge=1, le=32)
    assistant_confidence_threshold: float | None = Field(None, gt=0.0, lt=1.0)

    def speculation_params(self) -> SpeculationParams | None:
        tokens, confidence = self.num_assistant_tokens, self.assistant_confidence_threshold
        if tokens is not None and confidence is not None:
            raise BadRequest("num_assistant_tokens and assistant_confidence_threshold cannot be used together",
                             param="assistant_confidence_threshold")
        if tokens is None and confidence is None:
            return None
        param = "num_assistant_tokens" if tokens is not None else "assistant_confidence_threshold"
        return SpeculationParams(tokens, confidence, param)


BEAM_ONLY = frozenset({"length_penalty", "early_stopping", "diversity_penalty", "num_beam_groups"})


def plan_beams(ask: BeamAsk, sampling: SamplingParams, n: int, *, stream: bool, stop: tuple[str, ...],
               grammar: GrammarSpec | None, top_logprobs: int, top_param: str,
               prefix: str = "") -> BeamParams | None:
    """Beam search when the request asks for it, or (the OVMS reference's rule) when it gives ``best_of`` with
    sampling off: ``best_of`` greedy candidates would all be the same answer, so it is the beam width. What beam
    search cannot take is refused naming the field."""
    greedy_best_of = ask.best_of is not None and ask.best_of > 1 and sampling.is_greedy
    if not (ask.asked or greedy_best_of):
        for name in sorted(BEAM_ONLY & ask.fields_set):
            raise BadRequest(f"{name} applies to beam search (use_beam_search, or best_of with sampling off)",
                             param=prefix + name)
        return None
    param = ask.param if ask.asked else prefix + "best_of"
    if not sampling.is_greedy:
        raise BadRequest("beam search ranks the most likely continuations: it takes no temperature above 0 "
                         "(sampling)", param=prefix + ("do_sample" if prefix else "temperature"))
    refusals = [(stream, "stream", "beam search answers once the search is done: it cannot stream"),
                (bool(stop), prefix + "stop", "stop strings are not applied to beams; use stop_token_ids"),
                (grammar is not None, _grammar_field(grammar),
                 "beam search does not take an output grammar (response_format, tools, a constraint)"),
                (top_logprobs > 0, top_param, "beam search reports each chosen token's logprob only"),
                (n > ask.width, prefix + "n", f"n={n} is more than the {ask.width} beams")]
    for refused, field, message in refusals:
        if refused:
            raise BadRequest(message, param=field)
    diverse = bool(ask.diversity_penalty) or (ask.groups or 1) > 1
    groups = (ask.groups or ask.width) if diverse else 1
    if ask.width % groups:
        raise BadRequest(f"{ask.width} beams do not split into {groups} groups", param=prefix + "num_beam_groups")
    return BeamParams(ask.width, ask.length_penalty, ask.early_stopping, param=param, groups=groups,
                      diversity_penalty=ask.diversity_penalty or 0.0)


def _grammar_field(grammar: GrammarSpec | None) -> str:
    """The field a beam refusal names: ``response_format`` for its schemas, else the constraint's own field."""
    if grammar is None or grammar.param.startswith(("response_format", "tool_choice")):
        return "response_format"
    return grammar.param


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)

