"""The OpenAI-compatible HTTP server and its asyncio client of the engine process."""
