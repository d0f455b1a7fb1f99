"""Request bodies of the OpenAI- and Anthropic-compatible endpoints (pydantic), and the two error formats.

Unknown fields are accepted and ignored, as the reference servers do; known fields are type- and range-checked,
so a malformed request is a 400 that says which field is wrong. Fields the server cannot honour (penalties,
logit_bias, best_of, suffix) are refused unless they hold their no-op value, rather than silently ignored.
The list and string limits below bound the work one request can ask for before it is refused.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

MAX_MESSAGES = 4096  # messages (or Anthropic content blocks) per request
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_TOOLS = 256  # tools per request
MAX_GRAMMAR_BYTES = 64 << 10  # a grammar, JSON schema or forced-tool grammar, as compiled

StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP)], None]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


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
    content: Union[str, Annotated[list[ContentPart], Field(max_length=MAX_MESSAGES)], None] = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str = Field(min_length=1, max_length=256)


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaSpec(_Lenient):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs json_schema: {\"name\": ..., \"schema\": {...}}")
        return self


class StreamOptions(_Lenient):
    include_usage: bool = False


class Sampling(_Lenient):
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, le=1_000_000)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=0, le=2**32 - 1)
    stop: Stop = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    model: str | None = None
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)  # vLLM's
    logit_bias: dict[str, float] | None = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v):
        if v:
            raise ValueError("penalties are not supported by this server (send 0 or leave it out)")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _no_repetition_penalty(cls, v):
        if v is not None and v != 1:
            raise ValueError("repetition_penalty is not supported by this server (send 1 or leave it out)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported by this server (send {} or leave it out)")
        return v


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    guided_grammar: str | None = None  # vLLM's extension: a Lark grammar the output must match
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = True  # a final assistant message is continued (prefill), not closed
    allow_special_tokens: bool = False  # control tokens written in user/tool content are those tokens


class CompletionRequest(Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    guided_grammar: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=1)
    suffix: str | None = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix (insertion) is not supported by this server")
        return v


class TokenizeRequest(_Lenient):
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(max_length=MAX_MESSAGES)] | None = None
    add_generation_prompt: bool = True
    allow_special_tokens: bool = False
    model: str | None = None


class DetokenizeRequest(_Lenient):
    tokens: list[int]
    model: str | None = None


def openai_error(message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ----- Anthropic -------------------------------------------------------------------------------------------------
class AnthropicContent(_Lenient):
    """A block inside a tool_result's content."""

    type: str
    text: str | None = None


class AnthropicBlock(_Lenient):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict | None = None
    tool_use_id: str | None = None
    content: Union[str, Annotated[list[AnthropicContent], Field(max_length=MAX_MESSAGES)], None] = None
    thinking: str | None = None


class AnthropicMessage(_Lenient):
    role: Literal["user", "assistant"]
    content: Union[str, Annotated[list[AnthropicBlock], Field(max_length=MAX_MESSAGES)]]


class AnthropicTool(_Lenient):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None


class AnthropicToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, min_length=1, max_length=256)
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self):
        if self.type == "tool" and not self.name:
            raise ValueError("type tool needs the tool's name")
        return self


class AnthropicThinking(_Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0)


class AnthropicOutputFormat(_Lenient):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class AnthropicOutputConfig(_Lenient):
    format: AnthropicOutputFormat | None = None


class _AnthropicPrompt(_Lenient):
    """What Messages and count_tokens share: everything that makes the prompt."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Union[str, Annotated[list[AnthropicBlock], Field(max_length=MAX_MESSAGES)], None] = None
    tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None
    allow_special_tokens: bool = False  # extension, as in chat completions


class MessagesRequest(_AnthropicPrompt):
    max_tokens: int = Field(ge=1)
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=1_000_000)  # the bound of the OpenAI endpoints
    min_p: float | None = Field(default=None, ge=0, le=1)  # extension
    seed: int | None = Field(default=None, ge=0, le=2**32 - 1)  # extension
    stream: bool = False
    metadata: dict | None = None
    output_config: AnthropicOutputConfig | None = None
    guided_grammar: str | None = None  # extension, as in the OpenAI endpoints


class CountTokensRequest(_AnthropicPrompt):
    pass


ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                         429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}
