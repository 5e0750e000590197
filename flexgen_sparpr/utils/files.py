"""Writing files so that a crash or a concurrent reader never sees half of one."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_atomic(path, text: str) -> None:
    """Write text via a temp file in the same folder, then rename it into place."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the usual mode
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path, data: dict) -> None:
    write_atomic(path, json.dumps(data, indent=2, default=str) + "\n")
