"""The checkpoint directory is one filesystem for the controller and every trainer rank: checked at start.

Each rank writes its own shards and the controller publishes and resumes them, so node-local disks would leave a
checkpoint that cannot be resumed.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from opd.utils.errors import ConfigError

if TYPE_CHECKING:  # the trainer worker imports this module, and needs no Ray at import
    from opd.distributed.workers.worker_group import WorkerGroup

MARKER_PREFIX = ".opd_shared_check"
"""Marker file names start with it; a fresh token per check keeps a killed run's markers from passing."""


def marker_name(token: str, rank: int, node: str) -> str:
    """The marker file of one rank (its node's name made safe for a file name)."""
    safe_node = re.sub(r"[^\w.-]", "_", node)  # \w: what str.isalnum() accepts, and _
    return f"{MARKER_PREFIX}_{token}_rank{rank}_{safe_node}"


def check_shared_directory(workers: WorkerGroup, directory: Path, key: str = "checkpointing.checkpoint_dir") -> None:
    """Every trainer rank writes a marker into ``directory``; the controller must see each one.

    Each rank then removes its own marker. ``key`` names the directory's config key in the error.

    Raises:
        ConfigError: a rank's marker is not visible to the controller (naming the nodes).
    """
    directory.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex[:12]
    written = workers.run_all("write_marker", str(directory), token)
    try:
        missing = [
            f"rank {rank} on node {node}" + (f" ({error})" if error else "")
            for rank, (name, node, error) in enumerate(written)
            if not (directory / name).is_file()
        ]
    finally:
        workers.run_all("remove_marker", str(directory), token)
    if missing:
        raise ConfigError(
            f"{key} '{directory}' is not one filesystem for every node: the controller does not see the marker "
            f"file written there by trainer {', '.join(missing)}. The checkpoint directory must be on a filesystem "
            "every node shares (NFS, Lustre, a mounted bucket); set it to such a path"
        )
