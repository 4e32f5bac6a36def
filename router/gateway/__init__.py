"""The OpenAI-compatible HTTP gateway: request bodies (completions, chat, the Responses API) and what
they mean to the router, answers and their streamed events, tool calls and reasoning parsed from output."""
