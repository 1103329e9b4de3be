"""The HTTP edge: thin aiohttp handlers (OpenAI and admin APIs), the relay to the
engines and its SSE framing, the error middleware."""
