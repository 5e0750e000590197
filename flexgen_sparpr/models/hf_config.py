"""A ModelSpec from a HF `config.json`: OPT, and the Llama family (Llama, Mistral, Qwen2).

Every key that HF's config class for the model type defines and that changes the maths is either
mapped onto the spec (and tested against HF: tests/models/test_families_vs_hf.py) or refused by
name; nothing is silently approximated. Keys HF's class does not define, HF's model ignores too.
"""
from __future__ import annotations

from ..errors import ConfigError
from .spec import ModelSpec

LLAMA_FAMILY = ("llama", "mistral", "qwen2")


class UnsupportedConfig(ConfigError):
    """A config.json value the engine cannot compute exactly."""


def _refuse(name: str, key: str, value, why: str):
    raise UnsupportedConfig(f"{name}: config.json {key}={value!r} is not supported ({why})")


def _size(cfg: dict, key: str, name: str, default=None) -> int:
    """A positive integer setting (layers, widths, heads, vocabulary, positions)."""
    v = cfg.get(key, default)
    if v is None:
        raise KeyError(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        _refuse(name, key, v, "expected a positive integer")
    return v


def _rope(cfg: dict, name: str) -> float:
    """rope_theta, refusing any RoPE variant but the default (old and new config layouts)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling")
    if isinstance(params, dict) and "full_attention" in params:  # per layer type: one entry each
        kinds = [v for k, v in params.items() if k.endswith("_attention")]
        if any(v != kinds[0] for v in kinds):
            _refuse(name, "rope_parameters", "per layer type", "one RoPE for every layer")
        params = params["full_attention"]
    if not isinstance(params, dict):
        _refuse(name, "rope_parameters", params, "expected a mapping")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        _refuse(name, "rope_parameters.rope_type", kind, "only default RoPE; scaled RoPE changes the positions")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
        if kind not in (None, "default"):
            _refuse(name, "rope_scaling", kind, "only default RoPE; scaled RoPE changes the positions")
    for where in (params, cfg):
        factor = where.get("partial_rotary_factor", 1.0)
        if factor not in (None, 1, 1.0):
            _refuse(name, "partial_rotary_factor", factor, "RoPE on every channel only")
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _sliding_window(cfg: dict, mt: str, name: str) -> int | None:
    """The attention window in tokens, or None (full attention everywhere). The engine runs a
    windowed model only while the context fits the window, where the window changes nothing."""
    if mt == "qwen2":
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        types = cfg.get("layer_types")
        if types is not None and "sliding_attention" not in types:
            return None
        return window
    if mt == "mistral":
        return cfg.get("sliding_window")
    return None


def _llama(cfg: dict, mt: str, name: str) -> ModelSpec:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        _refuse(name, "hidden_act", act, "SwiGLU with silu only")
    hidden, heads = _size(cfg, "hidden_size", name), _size(cfg, "num_attention_heads", name)
    window = _sliding_window(cfg, mt, name)
    if window is not None and (not isinstance(window, int) or window < 1):
        _refuse(name, "sliding_window", window, "a window must be a positive number of tokens")
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    pad = cfg.get("pad_token_id")
    bos = cfg.get("bos_token_id")
    attn_bias = bool(cfg.get("attention_bias", False))  # Llama: q, k, v and o carry biases
    return ModelSpec(
        arch="llama", name=name, num_layers=_size(cfg, "num_hidden_layers", name), hidden=hidden,
        num_heads=heads, num_kv_heads=_size(cfg, "num_key_value_heads", name, heads),
        head_dim=_size(cfg, "head_dim", name, hidden // heads), ffn=_size(cfg, "intermediate_size", name),
        vocab=_size(cfg, "vocab_size", name), max_pos=_size(cfg, "max_position_embeddings", name, 2048),
        norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=_rope(cfg, name),
        tie_embeddings=cfg.get("tie_word_embeddings", False),
        bos_id=bos if bos is not None else 1, eos_id=eos,
        pad_id=pad if pad is not None else (eos if eos is not None else 0),
        qkv_bias=mt == "qwen2" or attn_bias, o_bias=attn_bias, mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=window,
    )


def _opt(cfg: dict, name: str) -> ModelSpec:
    act = cfg.get("activation_function", "relu")
    if act != "relu":
        _refuse(name, "activation_function", act, "OPT with relu only")
    for key in ("enable_bias", "layer_norm_elementwise_affine"):
        if cfg.get(key, True) is not True:
            _refuse(name, key, cfg.get(key), "OPT's layers always carry biases and norm gains here")
    if cfg.get("_remove_final_layer_norm"):
        _refuse(name, "_remove_final_layer_norm", True, "the final layer norm is always applied")
    hidden, heads = _size(cfg, "hidden_size", name), _size(cfg, "num_attention_heads", name)
    proj = _size(cfg, "word_embed_proj_dim", name, hidden)
    return ModelSpec(
        arch="opt", name=name, num_layers=_size(cfg, "num_hidden_layers", name), hidden=hidden,
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, ffn=_size(cfg, "ffn_dim", name),
        vocab=_size(cfg, "vocab_size", name), max_pos=_size(cfg, "max_position_embeddings", name),
        word_embed_dim=proj if proj != hidden else 0,
        pre_norm=cfg.get("do_layer_norm_before", True),
        tie_embeddings=cfg.get("tie_word_embeddings", True),
        bos_id=cfg.get("bos_token_id", 2), eos_id=cfg.get("eos_token_id", 2),
        pad_id=cfg.get("pad_token_id", 1) if cfg.get("pad_token_id", 1) is not None else 1,
    )


def spec_from_hf_config(cfg: dict, name: str = "") -> ModelSpec:
    """Spec from a HF config.json dict; UnsupportedConfig (one line, naming the key) when a
    value would change the maths in a way the engine does not compute."""
    if not isinstance(cfg, dict):
        raise UnsupportedConfig(f"{name or 'model'}: config.json must hold a JSON object")
    mt = cfg.get("model_type", "")
    name = name or cfg.get("_name_or_path", "") or mt
    if mt == "opt":
        family = _opt
    elif mt in LLAMA_FAMILY or (not mt and "LlamaForCausalLM" in cfg.get("architectures", [])):
        family = lambda c, n: _llama(c, mt or "llama", n)  # noqa: E731
    else:
        raise UnsupportedConfig(f"{name}: unsupported model_type {mt!r} (supported: opt, {', '.join(LLAMA_FAMILY)})")
    try:
        return family(cfg, name)
    except KeyError as e:
        raise UnsupportedConfig(f"{name}: config.json lacks {e.args[0]!r}") from None
    except TypeError as e:  # a value of the wrong kind (a string where a number goes)
        raise UnsupportedConfig(f"{name}: config.json has a value of the wrong type ({e})") from None
