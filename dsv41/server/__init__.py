"""The OpenAI- and Anthropic-compatible HTTP server on the engine."""
