"""Where a run's results go: checked before any work, written atomically at the end, and never
lost: when the final write still fails, the generated ids and texts go to stdout and to a
fallback file whose path the error line gives."""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from ..errors import ConfigError
from ..utils.files import write_json_atomic


def writable_file(path, flag: str) -> Path:
    """The path of an output file, checked without making anything: not a folder, and its
    nearest existing folder writable (the missing ones are made when the file is written).
    ConfigError naming the flag otherwise."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file path")
    base = p.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise ConfigError(f"{flag} {path}: cannot make its folder {p.parent} ({base} is a file)")
    try:  # the only sure test of writability (root ignores modes; a file system may be read-only)
        fd, probe = tempfile.mkstemp(dir=base, prefix=f".{p.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write in {base} ({e.strerror})") from None
    return p


def _fallback_path() -> Path | None:
    """A file that can still be written: in the temp folder, else the current one."""
    name = f"flexgen-sparpr-results-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    for folder in (Path(tempfile.gettempdir()), Path.cwd()):
        try:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".fallback-", suffix=".tmp")
            os.close(fd)
            os.unlink(tmp)
            return folder / name
        except OSError:
            continue
    return None


def deliver(out: dict, output_json: Path | None, log_path: Path | None, log_text: str) -> None:
    """Write the results JSON (atomically), then append the FlexGen log; if the JSON cannot be
    written, print the ids and texts to stdout, save everything to a fallback file, and raise
    ConfigError naming both files."""
    if output_json is not None:
        try:
            write_json_atomic(output_json, out)
        except OSError as e:
            kept = {k: out.get(k) for k in ("model", "prompt_ids", "output_ids", "texts")}
            print(json.dumps(kept), flush=True)
            fallback, where = _fallback_path(), "stdout only"
            if fallback is not None:
                try:
                    write_json_atomic(fallback, out)
                    where = f"stdout and {fallback}"
                except OSError:
                    pass
            raise ConfigError(f"cannot write --output-json {output_json} ({e.strerror or e}); the results "
                              f"are on {where}") from None
    if log_path is not None:
        existed = Path(log_path).exists()
        try:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "a") as f:
                f.write(log_text + "\n")
        except OSError as e:
            if not existed:  # a failed run leaves no file it created (an empty log on a full disk)
                Path(log_path).unlink(missing_ok=True)
            raise ConfigError(f"cannot append to the log file {log_path} ({e.strerror}); "
                              + ("the results are in --output-json" if output_json else "use --no-log or --log-file")) from None
