"""The HTTP layer: our own ASGI app (OpenAI-compatible and native routes) served by hypercorn on trio."""
