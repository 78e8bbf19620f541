"""The version of corelib: ``corelib.__version__``, ``python -m corelib --version`` and the server's ``/version``."""

__version__ = "0.1.0"
