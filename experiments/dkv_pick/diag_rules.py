"""Which answer tokens would each residual-row rule keep exact? One dense prefill per batch, the
observation window's importance captured per layer, every rule applied offline (no encode, no
decode). Usage (repo root): .venv/bin/python experiments/dkv_pick/diag_rules.py SPLIT LENGTH TASK [TRIALS]
Prints, per trial, the share of the answer's tokens (the key's digits and the token that closes
it) kept among their block's 16 rows, over layers 15-29 (where keeping them exact recovers the
key: ../pick-explore/), for each rule."""
import os, random, sys
os.environ.setdefault("HF_HUB_OFFLINE", "1"); os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer
from flexgen_sparpr.bench.needle_prompt import NeedlePrompts
from flexgen_sparpr.bench.tasks import build_trial
from flexgen_sparpr.bench.texts import SPLITS, texts_of
from flexgen_sparpr.engine.config import EngineConfig, Policy
from flexgen_sparpr.engine.executor import Engine
from flexgen_sparpr.kv.dkv.importance import follow_spread, observation_importance
from flexgen_sparpr.kv.policy import KVPolicy
from flexgen_sparpr.weights.resolve import resolve_source

split, length, task = sys.argv[1], int(sys.argv[2]), sys.argv[3]
trials_n = int(sys.argv[4]) if len(sys.argv) > 4 else 3
src = resolve_source("smollm2-135m", "")
tok = AutoTokenizer.from_pretrained(src.tokenizer_dir)
sp = SPLITS[split]
builders = [NeedlePrompts(tok, t.path, "The secret passkey is") for t in texts_of(split)]
rng = random.Random(sp.seed)
trials = [build_trial(task, builders[i % len(builders)], length, sp.depths[i % len(sp.depths)], rng)
          for i in range(trials_n)]


def baseline(q, k, count=32, window=32):
    """Mean attention a token gets from `count` queries spread over the prompt before the window
    (each over its causal prefix), per query that can see it: what any query gives it."""
    import math
    b, h, s, d = q.shape
    hkv = k.shape[1]
    pos = torch.linspace(s // 8, s - window - 1, count).long()
    qs = q[:, :, pos].float().unflatten(1, (hkv, h // hkv))  # [B, Hkv, G, C, D]
    causal = torch.arange(s)[None, :] <= pos[:, None]  # [C, S]
    out = torch.zeros(b, s)
    for g in range(hkv):
        sc = torch.einsum("bqcd,bsd->bqcs", qs[:, g], k[:, g].float()) / math.sqrt(d)
        out += sc.masked_fill(~causal, float("-inf")).softmax(-1).sum(dim=(1, 2))
    seen = causal.sum(0).clamp(min=1)  # queries that see each token
    return out / seen * count  # as if every baseline query saw it: the window's scale


class Capture(KVPolicy):
    def __init__(self):
        self.imp, self.base = {}, {}

    def on_prefill(self, table, layer, q, k, valid):
        self.imp[layer] = observation_importance(q, k, valid)  # [B, S]
        self.base[layer] = baseline(q, k)


def decay_spread(imp, follow):
    """score[t] = imp[t] + max_j imp[t-j] * (1 - j / (follow + 1)), j = 0..follow."""
    out = imp.clone()
    for j in range(1, follow + 1):
        out_j = F.pad(imp, (j, 0))[:, :imp.shape[1]] * (1 - j / (follow + 1))
        out = torch.maximum(out, out_j) if j > 1 else torch.maximum(imp, out_j)
    return imp + out


def no_sink(imp, n=4):
    src = imp.clone()
    src[:, :n] = 0  # attention sinks (StreamingLLM's 4 first tokens) are not matches: no spread
    return src


M, BS = 16, 256
RULES = {
    "follow8 (now)": lambda imp: follow_spread(imp, 8),
    "follow16": lambda imp: follow_spread(imp, 16),
    "follow8, no sink spread": lambda imp: imp + follow_spread(no_sink(imp), 8) - no_sink(imp),
    "follow16 decay": lambda imp: decay_spread(imp, 16),
    "follow16 decay, no sink spread": lambda imp: imp + decay_spread(no_sink(imp), 16) - no_sink(imp),
}
def specific(imp, layer):
    return (imp - cap.base[layer]).clamp(min=0)  # the mass the question gives beyond any query's


RULES["follow8 of specific mass"] = lambda imp, layer: imp + follow_spread(specific(imp, layer), 8) - specific(imp, layer)
RULES["follow16 decay of specific"] = lambda imp, layer: imp + decay_spread(specific(imp, layer), 16) - specific(imp, layer)
cap = Capture()
with Engine(src, Policy(gpu_batch_size=len(trials)), EngineConfig(device="cpu", block_size=BS)) as eng:
    eng.prefill([t.ids for t in trials], 1, observers=(cap,))
L = src.spec.num_layers
for b, t in enumerate(trials):
    key_tokens = [i for i in range(t.where[0], t.where[0] + 40) if i < len(t.ids)
                  and tok.decode([t.ids[i]]).strip().isdigit()]
    answer = key_tokens + [key_tokens[-1] + 1]  # digits and the token that closes the key
    print(f"trial {b} {t.text} depth {t.depth} key {t.expected} at {answer[0]} (block {answer[0] // BS})")
    for name, rule in RULES.items():
        kept = 0
        for layer in range(15, L):
            score = (rule(cap.imp[layer], layer) if rule.__code__.co_argcount == 2 else rule(cap.imp[layer]))[b]
            sealed = len(t.ids) // BS
            rows = set()
            for blk in {a // BS for a in answer}:
                if blk < sealed - 1:  # cold (the newest sealed block stays exact)
                    rows |= set((score[blk * BS:(blk + 1) * BS].topk(M).indices + blk * BS).tolist())
                else:
                    rows |= set(range(blk * BS, (blk + 1) * BS))
            kept += sum(a in rows for a in answer)
        print(f"  {name:32s} {kept}/{len(answer) * (L - 15)}")

if os.environ.get("SHOW"):  # the rows a rule keeps in the answer's block, at a few upper layers
    rule = RULES[os.environ["SHOW"]]
    for b, t in enumerate(trials):
        digit = next(i for i in range(t.where[0], len(t.ids)) if tok.decode([t.ids[i]]).strip().isdigit())
        blk = digit // BS
        for layer in (17, 21, 25):
            score = (rule(cap.imp[layer], layer) if rule.__code__.co_argcount == 2 else rule(cap.imp[layer]))[b][blk * BS:(blk + 1) * BS]
            top = score.topk(M).indices.sort().values + blk * BS
            print(f"trial {b} layer {layer}: " + " ".join(repr(tok.decode([t.ids[i]])) for i in top.tolist()))
