"""A ModelSpec from a HF `config.json`: OPT, and the Llama family (Llama, Mistral, Qwen2).

Every key that HF's config class for the model type defines and that changes the maths is either
mapped onto the spec (and tested against HF: tests/models/test_families_vs_hf.py) or refused by
name; nothing is silently approximated. Keys HF's class does not define, HF's model ignores too.
"""
from __future__ import annotations

from .config_keys import ConfigKeys, UnsupportedConfig
from .spec import ModelSpec

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
__all__ = ["LLAMA_FAMILY", "UnsupportedConfig", "spec_from_hf_config"]


def _rope(c: ConfigKeys) -> float:
    """rope_theta, refusing any RoPE variant but the default (old and new config layouts)."""
    cfg = c.cfg
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling")
    if isinstance(params, dict) and "full_attention" in params:  # per layer type: one entry each
        kinds = [v for k, v in params.items() if k.endswith("_attention")]
        if any(v != kinds[0] for v in kinds):
            c.refuse("rope_parameters", "per layer type", "one RoPE for every layer")
        params = params["full_attention"]
    if not isinstance(params, dict):
        c.refuse("rope_parameters", params, "expected a mapping")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        c.refuse("rope_parameters.rope_type", kind, "only default RoPE; scaled RoPE changes the positions")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else scaling
        if kind not in (None, "default"):
            c.refuse("rope_scaling", kind, "only default RoPE; scaled RoPE changes the positions")
    for where in (params, cfg):
        factor = where.get("partial_rotary_factor", 1.0)
        if factor is not None and (isinstance(factor, bool) or factor != 1):
            c.refuse("partial_rotary_factor", factor, "RoPE on every channel only")
    where = params if params.get("rope_theta") is not None else cfg
    return c.number("rope_theta", 10000.0, where)


def _sliding_window(c: ConfigKeys, mt: str) -> int | None:
    """The attention window in tokens, or None (full attention everywhere). The engine runs a
    windowed model only while the context fits the window, where the window changes nothing."""
    if mt == "qwen2":
        if not c.flag("use_sliding_window", False):
            return None
        types = c.cfg.get("layer_types")
        if types is not None and not (isinstance(types, list) and all(isinstance(t, str) for t in types)):
            c.refuse("layer_types", types, "expected a list of layer type names")
        if types is not None and "sliding_attention" not in types:
            return None
    elif mt != "mistral":
        return None
    return None if c.cfg.get("sliding_window") is None else c.size("sliding_window")


def _llama(c: ConfigKeys, mt: str, name: str) -> ModelSpec:
    act = c.text("hidden_act", "silu")
    if act != "silu":
        c.refuse("hidden_act", act, "SwiGLU with silu only")
    hidden, heads = c.size("hidden_size"), c.size("num_attention_heads")
    kv_heads = c.size("num_key_value_heads", heads)
    if c.cfg.get("head_dim") is None and hidden % heads:
        c.refuse("num_attention_heads", heads, f"it must divide hidden_size {hidden}")
    head_dim = c.size("head_dim", hidden // heads)
    c.heads(hidden, heads, kv_heads, head_dim)
    if head_dim % 2:
        c.refuse("head_dim", head_dim, "RoPE rotates pairs of channels: an even head width")
    vocab = c.size("vocab_size")
    eos = c.token_id("eos_token_id", None, vocab, many=True)
    pad = c.token_id("pad_token_id", None, vocab, many=True)
    bos = c.token_id("bos_token_id", None, vocab, many=True)
    attn_bias = c.flag("attention_bias", False)  # Llama: q, k, v and o carry biases
    return ModelSpec(
        arch="llama", name=name, num_layers=c.size("num_hidden_layers"), hidden=hidden,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, ffn=c.size("intermediate_size"),
        vocab=vocab, max_pos=c.size("max_position_embeddings", 2048),
        norm_eps=c.number("rms_norm_eps", 1e-6), rope_theta=_rope(c),
        tie_embeddings=c.flag("tie_word_embeddings", False),
        bos_id=bos if bos is not None else min(1, vocab - 1), eos_id=eos,
        pad_id=pad if pad is not None else (eos if eos is not None else 0),
        qkv_bias=mt == "qwen2" or attn_bias, o_bias=attn_bias, mlp_bias=c.flag("mlp_bias", False),
        sliding_window=_sliding_window(c, mt),
    )


def _opt(c: ConfigKeys, name: str) -> ModelSpec:
    act = c.text("activation_function", "relu")
    if act != "relu":
        c.refuse("activation_function", act, "OPT with relu only")
    for key in ("enable_bias", "layer_norm_elementwise_affine"):
        if c.cfg.get(key, True) is not True:
            c.refuse(key, c.cfg.get(key), "OPT's layers always carry biases and norm gains here")
    if c.cfg.get("_remove_final_layer_norm"):
        c.refuse("_remove_final_layer_norm", c.cfg["_remove_final_layer_norm"], "the final layer norm is always applied")
    hidden, heads = c.size("hidden_size"), c.size("num_attention_heads")
    if hidden % heads:
        c.refuse("num_attention_heads", heads, f"it must divide hidden_size {hidden}")
    proj = c.size("word_embed_proj_dim", hidden)
    vocab = c.size("vocab_size")
    pad = c.token_id("pad_token_id", 1, vocab)
    return ModelSpec(
        arch="opt", name=name, num_layers=c.size("num_hidden_layers"), hidden=hidden,
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, ffn=c.size("ffn_dim"),
        vocab=vocab, max_pos=c.size("max_position_embeddings"),
        word_embed_dim=proj if proj != hidden else 0,
        pre_norm=c.flag("do_layer_norm_before", True),
        tie_embeddings=c.flag("tie_word_embeddings", True),
        bos_id=c.token_id("bos_token_id", min(2, vocab - 1), vocab) or 0,
        eos_id=c.token_id("eos_token_id", min(2, vocab - 1), vocab, many=True),
        pad_id=pad if pad is not None else min(1, vocab - 1),
    )


def spec_from_hf_config(cfg: dict, name: str = "", where: str | None = None) -> ModelSpec:
    """Spec from a HF config.json dict; UnsupportedConfig (one line, naming the file, the key and
    the value) when a value is of the wrong type or range, or would change the maths in a way the
    engine does not compute. where: the file, for the messages (default: `<name>: config.json`)."""
    if not isinstance(cfg, dict):
        raise UnsupportedConfig(f"{where or (name or 'model') + ': config.json'}: must hold a JSON object")
    mt, known = cfg.get("model_type", ""), cfg.get("_name_or_path", "")
    name = name or (known if isinstance(known, str) else "") or (mt if isinstance(mt, str) else "")
    c = ConfigKeys(cfg, where or f"{name}: config.json")
    mt = c.text("model_type", "")
    archs = cfg.get("architectures") or []
    if mt == "opt":
        return _opt(c, name)
    if mt in LLAMA_FAMILY or (not mt and isinstance(archs, list) and "LlamaForCausalLM" in archs):
        return _llama(c, mt or "llama", name)
    raise UnsupportedConfig(f"{c.where}: unsupported model_type {mt!r} (supported: opt, {', '.join(LLAMA_FAMILY)})")
