"""The tools of a Responses request, as the chat request offers them to the model.

- ``function`` tools: offered as they are.
- ``namespace`` tools (a name, a description and functions under it, as Codex groups its sub-agent tools): each
  function is offered under its namespaced name, ``<namespace>__<name>``; a call the model makes to one comes back as
  OpenAI writes it, a ``function_call`` whose ``name`` is the function's own and whose ``namespace`` is the group's
  (``ToolSet.namespaced``), and a call sent back that way is rendered under the namespaced name again.
- Tools this server cannot run or offer (OpenAI's hosted tools: ``web_search``, ``file_search``, ``code_interpreter``,
  ``computer_use_preview``, ``image_generation``, ``mcp``, ...; and the tools called with free-form input or by the
  client's own item types: ``custom``, ``local_shell``, ``shell``, ``apply_patch``, ``tool_search``): left out of
  what the model sees, so a client that offers them by default still works; the endpoint says so in the log. A
  request that forces one through ``tool_choice`` is refused (400 naming ``tool_choice``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from handler.errors import BadRequest

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
UNOFFERED_TYPES = (
    "file_search", "computer", "computer_use", "computer_use_preview", "web_search", "web_search_2025_08_26",
    "web_search_preview", "web_search_preview_2025_03_11", "mcp", "code_interpreter", "programmatic_tool_calling",
    "image_generation", "local_shell", "shell", "custom", "tool_search", "apply_patch",
)
# between a namespace's name and its function's, in the name the model sees: a function name allows letters, digits,
# "_" and "-" only (OpenAI's rule, which chat checks), and MCP clients (Codex's own) join server and tool this way
SEPARATOR = "__"


class FunctionTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # OpenAI's fields about who may call it and how; nothing here changes with them
    allowed_callers: list[str] | None = None
    async_: bool | None = Field(None, alias="async")
    defer_loading: bool | None = None
    output_schema: dict[str, Any] | None = None


class UnofferedTool(BaseModel):
    """A tool this server cannot offer the model (module doc): its own fields are kept, only to be repeated."""

    model_config = ConfigDict(extra="allow")
    type: Literal[UNOFFERED_TYPES]  # type: ignore[valid-type]


class NamespaceTool(BaseModel):
    model_config = _STRICT
    type: Literal["namespace"]
    name: str
    description: str = ""
    tools: list[Annotated[FunctionTool | UnofferedTool, Field(discriminator="type")]]


Tool = Annotated[FunctionTool | NamespaceTool | UnofferedTool, Field(discriminator="type")]


class ToolChoiceFunction(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class ToolChoiceOther(BaseModel):
    """A tool choice naming a kind of tool (``{"type": "web_search"}``, ``allowed_tools``, ``mcp``, ...)."""

    model_config = ConfigDict(extra="allow")
    type: str


ToolChoice = Literal["none", "auto", "required"] | ToolChoiceFunction | ToolChoiceOther


@dataclass(frozen=True, slots=True)
class ToolSet:
    """What the model is offered: chat tools, which of their names are namespaced, and what was left out."""

    chat_tools: list[dict] = field(default_factory=list)
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # offered name -> (namespace, name)
    left_out: list[tuple[str, str]] = field(default_factory=list)         # (field, type) of each tool left out
    fields: list[str] = field(default_factory=list)                       # the field each chat tool came from

    def offered_name(self, name: str, param: str) -> str:
        """The offered name a forced call names: a function's own, a namespaced one, or a namespaced function's
        own name when no other function has it."""
        if any(tool["function"]["name"] == name for tool in self.chat_tools):
            return name
        matches = [offered for offered, (_space, own) in self.namespaced.items() if own == name]
        if len(matches) == 1:
            return matches[0]
        raise BadRequest(f"no function tool named {name!r} is offered", param=param)


def offered_tools(tools: list[FunctionTool | NamespaceTool | UnofferedTool]) -> ToolSet:
    chosen = ToolSet()
    for index, tool in enumerate(tools):
        if isinstance(tool, FunctionTool):
            chosen.chat_tools.append(_chat_tool(tool, tool.name))
            chosen.fields.append(f"tools[{index}]")
        elif isinstance(tool, UnofferedTool):
            chosen.left_out.append((f"tools[{index}]", tool.type))
        else:
            for inner_index, inner in enumerate(tool.tools):
                if isinstance(inner, UnofferedTool):
                    chosen.left_out.append((f"tools[{index}].tools[{inner_index}]", inner.type))
                    continue
                offered = f"{tool.name}{SEPARATOR}{inner.name}"
                chosen.chat_tools.append(_chat_tool(inner, offered))
                chosen.fields.append(f"tools[{index}].tools[{inner_index}]")
                chosen.namespaced[offered] = (tool.name, inner.name)
    return chosen


def chat_tool_choice(choice: ToolChoice | None, tools: ToolSet) -> str | dict | None:
    """``tool_choice`` as the chat request's: a forced function by its offered name; forcing a tool the model is
    not offered is refused."""
    if isinstance(choice, ToolChoiceFunction):
        name = tools.offered_name(choice.name, "tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    if isinstance(choice, ToolChoiceOther) and choice.type == "function":
        raise BadRequest("tool_choice of type function names the function", param="tool_choice.name")
    if isinstance(choice, ToolChoiceOther):
        raise BadRequest(f"tool_choice {choice.type!r} forces a tool this server cannot run or offer the model "
                         "(it is left out of what the model sees); use a function tool, or auto",
                         param="tool_choice.type")
    return choice


def _chat_tool(tool: FunctionTool, name: str) -> dict:
    function = {"name": name, "description": tool.description, "parameters": tool.parameters,
                "strict": tool.strict}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}
