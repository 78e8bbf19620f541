"""How torchrun started this process: how many nodes, and which one this is (no torch needed to ask)."""

from __future__ import annotations

import os


def launched_nodes() -> int:
    """How many corelib processes torchrun started (one per node); 1 without torchrun."""
    world = os.environ.get("WORLD_SIZE", "1")
    return int(world) if world.isdigit() and int(world) > 1 else 1


def launched_node() -> int:
    """This process's node (torchrun's ``RANK``, one process per node); 0 without torchrun."""
    rank = os.environ.get("RANK", "0")
    return int(rank) if launched_nodes() > 1 and rank.isdigit() else 0
