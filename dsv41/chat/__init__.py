"""Chat prompt encoding and completion parsing (docs/TOKENIZER-AND-CHAT.md)."""

from .encoding import (
    ASSISTANT,
    BOS,
    EOS,
    IMAGE_PLACEHOLDER,
    LATEST_REMINDER,
    REASONING_EFFORT_ALIASES,
    SYSTEM,
    THINK_END,
    THINK_START,
    USER,
    encode_messages,
    resolve_reasoning_effort,
)
from .parser import CompletionParseError, parse_completion

__all__ = [
    "ASSISTANT",
    "BOS",
    "EOS",
    "IMAGE_PLACEHOLDER",
    "LATEST_REMINDER",
    "REASONING_EFFORT_ALIASES",
    "SYSTEM",
    "THINK_END",
    "THINK_START",
    "USER",
    "CompletionParseError",
    "encode_messages",
    "parse_completion",
    "resolve_reasoning_effort",
]
