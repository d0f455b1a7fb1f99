"""Request bodies of the OpenAI- and Anthropic-compatible endpoints (pydantic), and the two error formats.

Unknown fields are accepted and ignored, as the reference servers do; known fields are type- and
range-checked, so a malformed request is a 400 that says which field is wrong.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


# ----- OpenAI ----------------------------------------------------------------------------------------------------
class FunctionCall(_Lenient):
    name: str
    arguments: Union[str, dict] = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(_Lenient):
    include_usage: bool = False


class Sampling(_Lenient):
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=2**32 - 1)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    model: str | None = None
    user: str | None = None


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    response_format: dict | None = None
    guided_grammar: str | None = None  # vLLM's extension: a Lark grammar the output must match
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict | None = None
    guided_grammar: str | None = None


class TokenizeRequest(_Lenient):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    model: str | None = None


class DetokenizeRequest(_Lenient):
    tokens: list[int]
    model: str | None = None


def openai_error(message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ----- Anthropic -------------------------------------------------------------------------------------------------
class AnthropicBlock(_Lenient):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict | None = None
    tool_use_id: str | None = None
    content: Union[str, list[dict], None] = None
    thinking: str | None = None


class AnthropicMessage(_Lenient):
    role: Literal["user", "assistant"]
    content: Union[str, list[AnthropicBlock]]


class AnthropicTool(_Lenient):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict = Field(default_factory=lambda: {"type": "object"})


class MessagesRequest(_Lenient):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[AnthropicBlock], None] = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    metadata: dict | None = None
    guided_grammar: str | None = None  # extension, as in the OpenAI endpoints


class CountTokensRequest(_Lenient):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[AnthropicBlock], None] = None
    tools: list[AnthropicTool] | None = None


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}
