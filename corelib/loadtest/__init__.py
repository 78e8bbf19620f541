"""Load-testing tools for an OpenAI-compatible server (``python -m corelib bench-serve``): the load
generator, its clients, an SSE reader, and a stand-in engine benchmark of the streaming path."""
