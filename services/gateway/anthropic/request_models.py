"""The Messages API's request bodies (Anthropic's field names), validated by pydantic.

Types and required fields are pydantic's (a 400 naming the field, in Anthropic's error
shape); the content blocks are plain dicts checked where they are converted
(conversion.py), so one message names the block that is wrong. Unknown fields are
logged and ignored, as on every other route.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# The gateway's request-body base (extra fields ignored with a warning, no NaN).
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.openai.request_models import INT32_MAX, _Body


class Thinking(BaseModel):
    """`{"type": "enabled", "budget_tokens": N}`, `{"type": "adaptive"}` (the same here)
    or `{"type": "disabled"}`. The budget is accepted and not enforced: the reasoning
    ends where the model ends it."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] | None = None


class Tool(BaseModel):
    """A client tool: its name, description and the JSON schema of its input. Server
    tools (web search, code execution, ...: a `type` other than "custom") run at
    Anthropic, not here: a 400 naming the tool."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class OutputFormat(BaseModel):
    """`output_config.format`: the answer is JSON following `schema` (structured outputs)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """`effort` is accepted and has no effect here; `format` constrains the answer."""

    model_config = ConfigDict(extra="ignore")
    effort: str | None = None
    format: OutputFormat | None = None


class ToolChoice(BaseModel):
    """auto (the model decides), any (some tool must be called), tool (this one),
    none (no call); `disable_parallel_tool_use`: at most one call."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesInput(_Body):
    """What /v1/messages and /v1/messages/count_tokens share: the conversation."""

    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(MessagesInput):
    """POST /v1/messages. `max_tokens` is required, as Anthropic's API requires it."""

    max_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)]
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Annotated[int, Field(le=INT32_MAX)] | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False
    service_tier: str | None = None
    # Anthropic-hosted features: refused by name (check), never silently dropped.
    container: Any = None
    mcp_servers: Any = None

    def check(self) -> None:
        for name in ("container", "mcp_servers"):
            if getattr(self, name):
                raise APIError(f"{name} is not supported: Pagoda runs no Anthropic-hosted "
                               f"tools or containers.", param=name)

    @property
    def user(self) -> str | None:
        """metadata.user_id, the session key of the `session` router."""
        user = (self.metadata or {}).get("user_id")
        return user if isinstance(user, str) else None


class CountTokensRequest(MessagesInput):
    """POST /v1/messages/count_tokens: the conversation only."""
