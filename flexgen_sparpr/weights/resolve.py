"""Turn the CLI's --model/--path into a weight source. Nothing here contacts a model hub."""
from __future__ import annotations

from pathlib import Path

from ..errors import CapacityError, ConfigError, ModelNotFound
from ..models import build_arch
from ..models.spec import OPT_NAMES, ModelSpec, opt_spec
from ..utils.paths import default_cache_dir
from .checked import check_tensors
from .sources import DummySource, GGUFSource, HFDirSource, NumpyDirSource, WeightSource

DUMMY = "_DUMMY_"
SMOLLM2 = "smollm2-135m"
KNOWN_NAMES = OPT_NAMES + (SMOLLM2,)

# SmolLM2-135M-Instruct's shape, so dummy runs need no download.
SMOLLM2_SPEC = ModelSpec(
    arch="llama", name=SMOLLM2, num_layers=30, hidden=576, num_heads=9, num_kv_heads=3,
    head_dim=64, ffn=1536, vocab=49152, max_pos=8192, norm_eps=1e-5, rope_theta=100000.0,
    tie_embeddings=True, bos_id=1, eos_id=2, pad_id=2,
)


def smollm2_dir() -> Path:
    return default_cache_dir() / SMOLLM2


def resolve_source(model: str, path: str, max_seq_len: int | None = None, seed: int = 0) -> WeightSource:
    """model: a local dir, a .gguf file, or a known name; path: FlexGen's --path (or _DUMMY_)."""
    dummy = DUMMY in (path or "")
    p = Path(model).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ModelNotFound(f"GGUF file not found: {p}")
        return _sized(GGUFSource(p), max_seq_len)
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelNotFound(f"{p} has no config.json (expected a HF checkpoint directory)")
        src = HFDirSource(p)
        if dummy:
            return _dummy(src.spec, max_seq_len, seed)
        return _sized(src, max_seq_len)
    key = model.split("/")[-1].lower()
    if key in OPT_NAMES:
        spec = opt_spec(key)
        if dummy:
            return _dummy(spec, max_seq_len, seed)
        root = Path(path).expanduser()
        np_dir = root / f"{key}-np"
        if np_dir.is_dir():
            return _sized(NumpyDirSource(np_dir, spec), max_seq_len)
        if (root / "config.json").exists():
            return _sized(HFDirSource(root), max_seq_len)
        raise ModelNotFound(
            f"no weights for {key}: put FlexGen numpy weights in {np_dir}/ or a HF checkpoint "
            f"directory at --path, or run with --path {DUMMY} for timing (no model hub is contacted)")
    if key in (SMOLLM2, "smollm2-135m-instruct"):
        if dummy:
            return _dummy(SMOLLM2_SPEC, max_seq_len, seed)
        d = smollm2_dir()
        if not (d / "config.json").exists():
            raise ModelNotFound(f"{SMOLLM2} is not prepared: run `flexgen-sparpr prepare` (expected in {d})")
        return _sized(HFDirSource(d), max_seq_len)
    raise ModelNotFound(
        f"unknown model {model!r}: give a local HF checkpoint directory, a .gguf file, or one of "
        f"{', '.join(KNOWN_NAMES)} (weights are never fetched from a model hub)")


def _dummy(spec: ModelSpec, max_seq_len: int | None, seed: int) -> WeightSource:
    if max_seq_len:
        spec = spec.with_max_pos(max(spec.max_pos, max_seq_len) if spec.arch == "llama" else max_seq_len)
    return DummySource(spec, build_arch(spec), seed)


def _sized(src: WeightSource, max_seq_len: int | None) -> WeightSource:
    """Real weights, checked against their config; a position table cannot grow, so a longer
    run is refused up front."""
    limit, what = src.spec.context_limit()
    if max_seq_len and max_seq_len > limit:
        raise CapacityError(f"{src.spec.name}: {max_seq_len} tokens exceed its {what} (--max-seq-len "
                            "sizes dummy weights only)")
    return check_tensors(src)
