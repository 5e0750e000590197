"""One upstream run that records its decode attention outputs (shared by the tests)."""
from __future__ import annotations

B, P, G = 2, 32, 3  # batch, prompt, new tokens: opt-125m stays about a second a run on 2 cores


def run_recording(sparpr=None, **kwargs):
    """Upstream with this engine's dummy weights, no warm-up; returns (result, outs): outs holds
    every decode attention layer's hidden output ([B, 1, h]) in call order."""
    import flexgen.pytorch_backend as backend
    from flexgen_sparpr.upstream.run import generate_upstream
    outs, mha_gen = [], backend.TorchDevice.mha_gen

    def recording(self, *args, **kw):
        ret = mha_gen(self, *args, **kw)
        outs.append(ret[0].data.clone())
        return ret

    backend.TorchDevice.mha_gen = recording
    try:
        args = dict(batch=B, prompt_len=P, gen_len=G, weights="engine", warmup=False) | kwargs
        return generate_upstream(sparpr=sparpr, **args), outs
    finally:
        backend.TorchDevice.mha_gen = mha_gen
