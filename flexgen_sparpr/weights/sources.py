"""Weight sources: where a model's tensors come from (HF dir, FlexGen numpy dir, GGUF, dummy).

Every source yields HF-named tensors on the CPU, one at a time, so a model larger than
host memory can stream straight into its tiers.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from ..models.hf_config import spec_from_hf_config
from ..models.spec import ModelSpec


class WeightsError(ConfigError):
    """A weight file that cannot be used as it is: unreadable, cut short, a tensor missing or
    of the wrong shape. The message names the file (and the tensor)."""


class WeightSource:
    spec: ModelSpec
    tokenizer_dir: Path | None = None

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def shape_of(self, name: str) -> tuple[int, ...] | None:
        """The stored shape of a tensor without reading it (KeyError when absent; None when
        the source cannot tell), so a checkpoint can be checked before anything loads."""
        return None

    def describe(self) -> str:
        return type(self).__name__


def _canonical(name: str) -> str:
    """Old OPT checkpoints name tensors 'decoder.*'; HF's current naming is 'model.decoder.*'."""
    return "model." + name if name.startswith("decoder.") else name


class HFDirSource(WeightSource):
    """A local HF checkpoint directory: config.json + *.safetensors or pytorch_model*.bin."""

    def __init__(self, path: Path):
        self.path = Path(path)
        cfg_file = self.path / "config.json"
        self.spec = spec_from_hf_config(read_config(cfg_file), name=self.path.name, where=str(cfg_file))
        self.tokenizer_dir = self.path if any(
            (self.path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")) else None
        self._index: dict[str, tuple[Path, str]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        files = sorted(self.path.glob("*.safetensors"))
        if files:
            from safetensors import safe_open
            for f in files:
                try:
                    with safe_open(str(f), "pt") as h:
                        for k in h.keys():
                            self._index[_canonical(k)] = (f, k)
                            self._shapes[_canonical(k)] = tuple(h.get_slice(k).get_shape())
                except Exception as e:  # SafetensorError: cut short, header damaged, not safetensors
                    raise WeightsError(f"{f}: not a readable safetensors file ({e})") from None
            self._bins = None
        else:
            bins = sorted(self.path.glob("pytorch_model*.bin"))
            if not bins:
                raise WeightsError(f"{self.path}: no *.safetensors or pytorch_model*.bin files")
            self._bins = {}
            for f in bins:
                try:
                    sd = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
                except Exception as e:  # unpickling errors of every kind: the file is not a state dict
                    raise WeightsError(f"{f}: not a readable torch state dict ({type(e).__name__}: {e})") from None
                if not isinstance(sd, dict):
                    raise WeightsError(f"{f}: holds a {type(sd).__name__}, not a state dict of tensors")
                for k, t in sd.items():
                    self._bins[_canonical(k)] = t

    def get(self, name: str) -> torch.Tensor:
        if self._bins is not None:
            return self._bins[name]
        from safetensors import safe_open
        f, key = self._index[name]
        try:
            with safe_open(str(f), "pt") as h:
                return h.get_tensor(key)
        except Exception as e:  # SafetensorError: the file changed or broke since it was opened
            raise WeightsError(f"{f}: cannot read tensor {key} ({e})") from None

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self._bins[name].shape) if self._bins is not None else self._shapes[name]

    def describe(self) -> str:
        return f"hf:{self.path}"


def read_config(path: Path) -> dict:
    """A config.json as a dict; WeightsError naming the file when it is not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise WeightsError(f"{path}: not valid JSON ({e})") from None


class NumpyDirSource(WeightSource):
    """FlexGen's converted layout: <path>/<model>-np/<tensor name without 'model.'>."""

    def __init__(self, path: Path, spec: ModelSpec):
        self.path, self.spec = Path(path), spec

    def get(self, name: str) -> torch.Tensor:
        f = self.path / name.removeprefix("model.")
        if not f.exists():  # FlexGen's converter renames the final norm
            f = self.path / name.removeprefix("model.").replace("decoder.final_layer_norm", "decoder.layer_norm")
        if not f.exists():
            raise KeyError(name)
        return torch.from_numpy(np.load(f))

    def shape_of(self, name: str) -> tuple[int, ...] | None:
        f = self.path / name.removeprefix("model.")
        if not f.exists():
            f = self.path / name.removeprefix("model.").replace("decoder.final_layer_norm", "decoder.layer_norm")
        if not f.exists():
            raise KeyError(name)
        try:
            return tuple(np.load(f, mmap_mode="r").shape)
        except (ValueError, OSError) as e:
            raise WeightsError(f"{f}: not a readable numpy file ({e})") from None

    def describe(self) -> str:
        return f"numpy:{self.path}"


class GGUFSource(WeightSource):
    """A GGUF file, dequantized to float32 once at load."""

    def __init__(self, path: Path):
        from .gguf_file import DamagedGGUF, read_gguf
        self.path = Path(path)
        try:
            cfg, self._sd = read_gguf(self.path)
        except (ConfigError, OSError):
            raise
        except DamagedGGUF as e:
            raise WeightsError(str(e)) from None
        except ValueError as e:  # the reader's own refusals (architecture, missing keys) read well
            raise WeightsError(f"{self.path}: {e}") from None
        except Exception as e:  # a valid magic, then junk: the reader fails wherever the junk starts
            raise WeightsError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
        self.spec = spec_from_hf_config(cfg, name=self.path.stem, where=f"{self.path} (its model metadata)")
        tok = self.path.parent / "tokenizer.json"
        self.tokenizer_dir = self.path.parent if tok.exists() else None

    def get(self, name: str) -> torch.Tensor:
        return self._sd[name]

    def shape_of(self, name: str) -> tuple[int, ...]:
        return tuple(self._sd[name].shape)

    def describe(self) -> str:
        return f"gguf:{self.path}"


class DummySource(WeightSource):
    """Deterministic random weights (FlexGen's _DUMMY_ path), seeded per tensor name.

    Values are small normals so activations stay finite and outputs are not constant;
    norm gains are ones, biases small.
    """

    def __init__(self, spec: ModelSpec, arch, seed: int = 0):
        self.spec, self.seed = spec, seed
        self._shapes = dummy_shapes(spec, arch)

    def get(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        if name.endswith("norm.weight") or "layer_norm.weight" in name:
            return torch.ones(shape)
        std = 0.02 if len(shape) > 1 else 0.01
        return torch.empty(shape).normal_(0.0, std, generator=g)

    def describe(self) -> str:
        return f"dummy(seed={self.seed})"


class OnceSource(WeightSource):
    """A source whose tensors are made once, in `dtype`, and handed as the same values to every
    engine that reads it (a benchmark's several LLMs on one model: dummy OPT-6.7B takes tens of
    seconds to draw)."""

    def __init__(self, src: WeightSource, dtype: torch.dtype):
        self.src, self.spec, self.dtype, self._made = src, src.spec, dtype, {}
        self.tokenizer_dir = src.tokenizer_dir

    def get(self, name: str) -> torch.Tensor:
        if name not in self._made:
            self._made[name] = self.src.get(name).to(self.dtype)
        return self._made[name]

    def describe(self) -> str:
        return self.src.describe()


def dummy_shapes(spec: ModelSpec, arch) -> dict[str, tuple[int, ...]]:
    """Every tensor name the engine reads, with its shape (HF layout: [out, in])."""
    h, f, kv, e = spec.hidden, spec.ffn, spec.kv_dim, spec.embed_dim
    shapes: dict[str, tuple[int, ...]] = {}

    def add(names: dict[str, str], table: dict[str, tuple[int, ...]]):
        for short, full in names.items():
            shapes[full] = table[short]

    common = {"tok": (spec.vocab, e), "pos": (spec.max_pos + 2, h), "proj_in": (h, e),
              "proj_out": (e, h), "ln.w": (h,), "ln.b": (h,)}
    add(arch.embed_names(), common)
    add(arch.head_names(), common)
    for i in range(spec.num_layers):
        add(arch.attn_names(i), {
            "ln.w": (h,), "ln.b": (h,), "q.w": (h, h), "q.b": (h,), "k.w": (kv, h), "k.b": (kv,),
            "v.w": (kv, h), "v.b": (kv,), "out.w": (h, h), "out.b": (h,), "o.w": (h, h), "o.b": (h,)})
        add(arch.mlp_names(i), {
            "ln.w": (h,), "ln.b": (h,), "fc1.w": (f, h), "fc1.b": (f,), "fc2.w": (h, f),
            "fc2.b": (h,), "gate.w": (f, h), "up.w": (f, h), "down.w": (h, f), "gate.b": (f,),
            "up.b": (f,), "down.b": (h,)})
    return shapes
