"""Request bodies of the three APIs, as pydantic models: a malformed body is a 400 naming the field.

Unknown fields are accepted and ignored (clients send `user`, `metadata`, vendor extensions); known
fields are typed and bounded.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")


# ------------------------------------------------------------------------------------ OpenAI chat
class ImageURL(Body):
    url: str
    detail: str | None = None


class ContentPart(Body):
    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None


class FunctionCall(Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(Body):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDef(Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(Body):
    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Thinking(Body):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=0)


class StreamOptions(Body):
    include_usage: bool = False


class Sampling(Body):
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    """Token id (as a string) → a bias in [-100, 100] added to its logit before sampling."""
    ignore_eos: bool = False
    """vLLM's extension: EOS does not end the answer; it runs to `max_tokens` or a stop string."""


class ChatCompletionRequest(Sampling):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    reasoning_effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    thinking: Thinking | None = None


class CompletionRequest(Sampling):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(default=16, ge=0)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None


# ------------------------------------------------------------------------------------ Anthropic
class Block(Body):
    type: str
    text: str | None = None
    thinking: str | None = None
    signature: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list["Block"] | None = None
    source: dict[str, Any] | None = None
    """An image block's source: {"type": "base64", "media_type", "data"} or {"type": "url", "url"}."""


class AnthropicMessage(Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(Body):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class AnthropicToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class MessagesRequest(Body):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = None
    stop_sequences: list[str] | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    stream: bool = False
