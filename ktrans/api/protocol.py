"""The OpenAI request schema (the parts ktrans serves) as pydantic models, and their translation to SamplingParams.

Field checks here become HTTP 400 errors in the OpenAI shape, naming the field. Unknown fields are accepted and
ignored, as OpenAI clients send fields a server may not know. Beyond OpenAI's fields, the vLLM extensions users
rely on are accepted: top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, chat_template_kwargs.

Structured outputs come from OpenAI's `response_format` (json_object, json_schema), vLLM's older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and its newer `structured_outputs` object; at most one constraint
per request, else a 400. `tool_choice` "required" or a named function is a constraint too: a grammar of Hermes
tool-call blocks (api/tools.py); "none" turns tool-call parsing off.
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from ktrans.api.tools import tool_call_grammar
from ktrans.engine.grammar import GrammarError, StructuredOutputs
from ktrans.engine.sampler import SamplingParams

MAX_TOP_LOGPROBS = 20


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: `usage` (counts so far) on every streamed chunk


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it: text parts joined, `developer` as `system`."""
        content = self.content
        if isinstance(content, list):
            bad = [p.type for p in content if p.type != "text"]
            if bad:
                raise ValueError(f"content parts of type {bad[0]!r} are not supported (text only)")
            content = "".join(p.text or "" for p in content)
        d = self.model_dump(exclude_none=True)
        d.update(role="system" if self.role == "developer" else self.role, content=content or "")
        return d


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    schema_: Union[dict[str, Any], bool, None] = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(OpenAIModel):
    """vLLM's `structured_outputs` request object (StructuredOutputsParams): exactly one constraint."""

    json_: Union[str, dict[str, Any], bool, None] = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(OpenAIModel):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: Union[str, dict[str, Any], bool, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted; llguidance serves every kind

    def structured(self) -> StructuredOutputs | None:
        """The request's structured output constraint, or None. A ValueError (GrammarError) names the field when
        there are several or one is malformed; whether it compiles is checked later, against the tokenizer."""
        found = self._constraints()
        if len(found) > 1:
            names = ", ".join(c.param or "?" for c in found)
            raise GrammarError(f"give one structured output constraint, not several: {names}", found[1].param)
        return found[0] if found else None

    def _constraints(self) -> list[StructuredOutputs]:
        rf, so = self.response_format, self.structured_outputs
        out: list[StructuredOutputs] = []
        if rf is not None and rf.type == "json_object":
            out.append(StructuredOutputs(json_object=True, param="response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise GrammarError('response_format {"type": "json_schema"} needs json_schema.schema',
                                   "response_format.json_schema")
            out.append(StructuredOutputs.from_schema(rf.json_schema.schema_, "response_format.json_schema.schema"))
        if so is not None:
            given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(so, k) is not None]
            given += ["json_object"] if so.json_object else []
            if len(given) != 1:
                raise GrammarError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
                                   "structured_outputs")
            kind = given[0].rstrip("_")
            out.append(_constraint(kind, getattr(so, given[0]), f"structured_outputs.{kind}"))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                out.append(_constraint(name, value, f"guided_{name}"))
        return out

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return stops

    def sampling_params(self, max_tokens: int | None, logprobs: int, return_logprobs: bool,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            logprobs=logprobs,
            return_logprobs=return_logprobs,
            prompt_logprobs=prompt_logprobs,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            max_tokens=max_tokens,
            stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            structured=self.structured(),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage_stats(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        max_tokens = self.max_completion_tokens or self.max_tokens
        return self.sampling_params(max_tokens, self.top_logprobs or 0, self.logprobs)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if isinstance(v, str) and v not in ("none", "auto", "required"):
            raise ValueError(f'tool_choice is "none", "auto", "required" or a named function, not {v!r}')
        if isinstance(v, dict) and (v.get("type") != "function" or not isinstance(v.get("function"), dict)):
            raise ValueError('a named tool_choice is {"type": "function", "function": {"name": ...}}')
        return v

    def _constraints(self) -> list[StructuredOutputs]:
        """Beside the output constraints, tool_choice "required" or a named function: a grammar of tool calls."""
        out = super()._constraints()
        choice = self.tool_choice
        if choice == "required" or isinstance(choice, dict):
            name = choice["function"].get("name") if isinstance(choice, dict) else None
            grammar = tool_call_grammar(self.tools or [], name, self.parallel_tool_calls is not False)
            out.append(StructuredOutputs(grammar=grammar, param="tool_choice"))
        return out

    @property
    def parse_tools(self) -> bool:
        """Whether tool calls in the output become `tool_calls` (there are tools and tool_choice is not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def enable_thinking(self) -> bool:
        return (self.chat_template_kwargs or {}).get("enable_thinking", True) is not False


Prompt = Union[str, list[str], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("the prompt list is empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def to_sampling_params(self) -> SamplingParams:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo=true, to score the prompt)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        lp = self.logprobs
        return self.sampling_params(self.max_tokens, lp or 0, lp is not None,
                                    prompt_logprobs=lp if (self.echo and lp is not None) else None)


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[StrictInt]


def _constraint(kind: str, value: Any, param: str) -> StructuredOutputs:
    if kind == "json":
        return StructuredOutputs.from_schema(value, param)
    if kind == "json_object":
        return StructuredOutputs(json_object=True, param=param)
    if kind == "choice":
        if not value:
            raise GrammarError("the choice list is empty", param)
        return StructuredOutputs(choice=tuple(value), param=param)
    if not value:
        raise GrammarError(f"{param} is empty", param)
    return StructuredOutputs(**{kind: value}, param=param)


def error_body(message: str, type_: str, code: int | str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
