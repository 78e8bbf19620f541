"""Hydra config tree of corelib, importable as ``corelib.conf`` from any install."""
