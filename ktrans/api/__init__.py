"""The OpenAI-compatible HTTP API: the FastAPI app, its protocol, formatting, tool calls and reasoning, the server."""
