"""SageMaker's custom attributes: ``X-Amzn-SageMaker-Custom-Attributes`` read once into a request's properties.

``InvokeEndpoint`` forwards one header of the caller's own, up to 1,024 ASCII characters, and the convention (LMI's,
and the SageMaker toolkits') is ``key=value`` pairs separated by ``;``. Keys are case-insensitive and values are
stripped. The attributes this server reads:

- ``extra-parameters``: the request's policy for fields the schema does not declare (``common.ExtraParameters``);
- ``x-priority``: the request's scheduling priority, an integer, lower first (vLLM's ``priority`` meaning);
  a chat or completions body's own ``priority`` field wins over it.

Any other attribute is the caller's own business (a trace id, a tenant): it is logged at debug level and never an
error. A header over the length, not ASCII, or an attribute this server reads with a bad value is a 400 naming the
header.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from handler.errors import BadRequest

log = logging.getLogger(__name__)

CUSTOM_ATTRIBUTES_HEADER = "X-Amzn-SageMaker-Custom-Attributes"
MAX_CUSTOM_ATTRIBUTES_CHARS = 1024         # InvokeEndpoint's CustomAttributes constraint
# vLLM's bound on a body's priority (an int64); ours, so the scheduler's sort keys stay plain integers
PRIORITY_BOUND = 2**63 - 1
KNOWN = ("extra-parameters", "x-priority")


@dataclass(frozen=True, slots=True)
class RequestProperties:
    """What a request's custom attributes say (None: the attribute was not given)."""

    extra_parameters: str | None = None
    priority: int | None = None


NO_PROPERTIES = RequestProperties()


def parse_custom_attributes(header: str | None) -> RequestProperties:
    """The properties in a ``key=value; key=value`` custom-attributes header (module doc)."""
    if not header:
        return NO_PROPERTIES
    if len(header) > MAX_CUSTOM_ATTRIBUTES_CHARS or not header.isascii():
        raise BadRequest(f"{CUSTOM_ATTRIBUTES_HEADER} must be at most {MAX_CUSTOM_ATTRIBUTES_CHARS} ASCII characters "
                         f"(it has {len(header)})", param=CUSTOM_ATTRIBUTES_HEADER)
    values: dict[str, str] = {}
    for part in header.split(";"):
        name, equals, value = part.partition("=")
        key = name.strip().lower()
        if equals and key in KNOWN:
            values[key] = value.strip()
        elif part.strip():
            log.debug("custom attribute %r is not one this server reads; ignored", part.strip()[:64])
    return RequestProperties(extra_parameters=values.get("extra-parameters"),
                             priority=_priority(values.get("x-priority")))


def _priority(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        priority = int(value)
    except ValueError:
        priority = None
    if priority is None or abs(priority) > PRIORITY_BOUND:
        raise BadRequest(f"x-priority={value!r} in {CUSTOM_ATTRIBUTES_HEADER} must be an integer (lower runs first)",
                         param=CUSTOM_ATTRIBUTES_HEADER)
    return priority
