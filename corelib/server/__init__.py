"""An OpenAI-compatible HTTP server over the engine (``python -m corelib serve``) and its load
generator (``python -m corelib bench-serve``). Needs the ``serve`` extra: ``pip install corelib[serve]``."""
