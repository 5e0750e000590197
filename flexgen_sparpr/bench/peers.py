"""The peers the benchmarks time this engine against, one runner each, shared by every script:

- upstream FlexGen (flexgen==0.1.8, flexgen_sparpr/upstream) in a child process, with a timeout;
- HF transformers: `generate` on a loaded checkpoint (hf_generate), or OPT with random weights
  under accelerate's offload below a memory cap (hf_offload_opt);
- llama.cpp (llama-cpp-python, an optional bench extra) on a GGUF: greedy, a batch of prompts (llamacpp_greedy).

A runner returns a dict: {"ok": True, "prefill_s", "decode_s" or "step_s", ...} when it ran,
{"ok": False, "error": one line} when it did not (a timeout also sets "timeout", an OOM "oom").
"""
from __future__ import annotations

import time

GiB = 1 << 30


# --- upstream FlexGen ---
def upstream(timeout: float, **command) -> dict:
    """Upstream FlexGen in a child process (`command`: upstream_command's keyword arguments),
    stopped after `timeout` seconds: its parsed result (flexgen_sparpr.upstream.run.parse_child)."""
    import subprocess
    try:
        from ..upstream.run import parse_child, upstream_command
    except ImportError as e:
        return {"ok": False, "error": f"not available ({e})"}
    try:
        proc = subprocess.run(upstream_command(**command), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "timeout": True, "error": f"timed out after {timeout:g} s"}
    return parse_child(proc.returncode, proc.stdout, proc.stderr)


# --- HF transformers ---
def load_hf(path, dtype: str, device: str):
    """A HF causal LM from a checkpoint folder, in `dtype` on `device`, for inference."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()


def hf_generate(model, prompts: list[list[int]], gen_len: int) -> dict:
    """One ordinary greedy `model.generate` call on equal-length prompts; a pass-through
    LogitsProcessor timestamps every step right after its forward. prefill_s = first stamp -
    call start; step_s: the gen_len - 1 one-token steps after it. Returns tokens [batch][gen_len]."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores):
            self.t.append(time.perf_counter())
            return scores

    ids = torch.tensor(prompts, dtype=torch.long, device=model.device)
    stamp = Stamp()
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len,
                             do_sample=False, eos_token_id=None,
                             logits_processor=LogitsProcessorList([stamp]))
    new = out[:, ids.shape[1]:].tolist()
    if len(stamp.t) != gen_len or len(new[0]) != gen_len:
        raise RuntimeError(f"HF generate made {len(new[0])} tokens in {len(stamp.t)} steps, expected {gen_len}")
    steps = [b - a for a, b in zip(stamp.t, stamp.t[1:])]
    return {"tokens": new, "prefill_s": stamp.t[0] - t0, "step_s": steps}


def hf_need(spec, batch: int, ctx: int, gen_len: int) -> dict:
    """float32 bytes HF must hold on the compute tier beside its weights: the KV cache at the
    end of generation and the prefill's widest activations (SDPA: no [S, S] score matrix kept)."""
    n = ctx + gen_len
    kv = 2 * batch * n * spec.num_layers * spec.kv_dim * 4
    act = batch * ctx * (spec.hidden * 4 + spec.ffn) * 4
    return {"weights": spec.num_params() * 4, "kv": kv, "activations": act}


def hf_offload_opt(spec, prompts: list[list[int]], gen_len: int, cap: float, seed: int, offload_dir: str) -> dict:
    """HF OPT shaped as `spec`, random weights (seeded), float32 on the CPU, its weights given
    max_memory = cap - (KV cache + activations) and accelerate offloading the rest to disk; a
    greedy prefill then gen_len - 1 one-token steps. When the KV cache and activations alone
    exceed the cap: {"ok": False, "oom": True} without running (they would have to fit)."""
    import tempfile

    import torch
    from accelerate import dispatch_model, infer_auto_device_map
    from transformers import OPTConfig, OPTForCausalLM

    from ..api.measure import PeakMemory

    batch, ctx = len(prompts), len(prompts[0])
    need = hf_need(spec, batch, ctx, gen_len)
    room = cap - need["kv"] - need["activations"]
    if room <= 0:
        return {"ok": False, "oom": True, "need": need,
                "error": f"OOM: KV cache + activations {(need['kv'] + need['activations']) / GiB:.2f} GiB "
                         f"exceed the {cap / GiB:.2f} GiB compute-tier cap"}
    cfg = OPTConfig(hidden_size=spec.hidden, num_attention_heads=spec.num_heads, num_hidden_layers=spec.num_layers,
                    ffn_dim=spec.ffn, vocab_size=spec.vocab, max_position_embeddings=ctx + gen_len,
                    word_embed_proj_dim=spec.embed_dim, do_layer_norm_before=spec.pre_norm)
    torch.manual_seed(seed)
    model = OPTForCausalLM(cfg).eval()
    dmap = infer_auto_device_map(model, max_memory={"cpu": int(room), "disk": 1 << 42},
                                 no_split_module_classes=["OPTDecoderLayer"])
    on_disk = sum(1 for v in dmap.values() if v == "disk")
    ids = torch.tensor(prompts)
    with tempfile.TemporaryDirectory(dir=offload_dir) as tmp, PeakMemory(torch.device("cpu")) as peak:
        model = dispatch_model(model, dmap, main_device="cpu", offload_dir=tmp)
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model(input_ids=ids, use_cache=True)
            prefill = time.perf_counter() - t0
            cache, nxt = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)  # transformers 5: `cache`
            t0 = time.perf_counter()
            for _ in range(gen_len - 1):  # greedy decode, the same loop as generate without its checks
                out = model(input_ids=nxt, cache=cache, use_cache=True)
                cache, nxt = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
            decode = time.perf_counter() - t0
    return {"ok": True, "prefill_s": prefill, "decode_s": decode, "need": need, "weights_room": room,
            "modules_on_disk": on_disk, "peak_rss_bytes": peak.report()["host_rss_peak_bytes"]}


# --- llama.cpp ---
def llamacpp_version() -> str | None:
    """llama-cpp-python's version, or None when it is not installed (an optional bench extra)."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.__version__


def llamacpp_greedy(gguf, prompts: list[list[int]], gen_len: int, threads: int, n_batch: int = 512) -> dict:
    """llama.cpp (llama-cpp-python's C API) on a GGUF, one context holding a KV cache per prompt:
    each prompt's ids evaluated in chunks of n_batch (prefill_s: all of them), then gen_len greedy
    tokens per prompt, each the argmax of its last logits, one decode call a step for the whole batch
    (step_s: each such call); settings as llama-cpp-python's Llama() makes them (flash attention
    off). Returns tokens: [prompts][gen_len]."""
    try:
        import numpy as np
        import llama_cpp as lc
    except ImportError as e:
        return {"ok": False, "error": f"not available ({e})"}
    lc.llama_log_set(_quiet(lc), None)
    n = len(prompts)
    model = lc.llama_model_load_from_file(str(gguf).encode(), lc.llama_model_default_params())
    if not model:
        return {"ok": False, "error": f"llama.cpp could not load {gguf}"}
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max, cp.kv_unified = n * (max(map(len, prompts)) + gen_len + 8), n, False  # a cache per prompt
    cp.n_batch = cp.n_ubatch = n_batch
    # flash attention off, as llama-cpp-python's Llama() has it: on this CPU its decode was faster so
    # (2k tokens, batch 1: 64 tok/s against 36 under the C API's default, auto)
    cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.n_threads = cp.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, cp)
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(max(n_batch, n), 0, 1)

    def run(items) -> None:  # items: (token, position, sequence, wants logits)
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, out) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, out
            batch.seq_id[i][0] = seq
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(i: int) -> int:  # the i-th token of the last call's logits
        return int(np.argmax(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(vocab,))))
    try:
        t0, tokens = time.perf_counter(), []
        for s, p in enumerate(prompts):
            for a in range(0, len(p), n_batch):
                run([(t, a + j, s, a + j == len(p) - 1) for j, t in enumerate(p[a:a + n_batch])])
            tokens.append([argmax((len(p) - 1) % n_batch)])
        prefill, steps = time.perf_counter() - t0, []
        for i in range(gen_len - 1):
            t0 = time.perf_counter()
            run([(tokens[s][-1], len(p) + i, s, True) for s, p in enumerate(prompts)])
            steps.append(time.perf_counter() - t0)
            for s in range(n):
                tokens[s].append(argmax(s))
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    return {"ok": True, "prefill_s": prefill, "step_s": steps, "tokens": tokens}


def _quiet_log(level, text, user_data) -> None:
    """llama.cpp's log lines, dropped (its load and context reports would drown the benchmark's)."""


_QUIET: list = []  # the C callback, made once and kept alive (llama.cpp holds the pointer)


def _quiet(lc):
    if not _QUIET:
        _QUIET.append(lc.llama_log_callback(_quiet_log))
    return _QUIET[0]
