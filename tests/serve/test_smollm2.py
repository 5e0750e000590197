"""The issue's bar: `flexgen-sparpr serve --model smollm2-135m` answers the openai client's
chat.completions.create(..., stream=True), greedily as LLM.generate does for the same question."""
from __future__ import annotations

import pytest

from flexgen_sparpr.api.llm import LLM

from tests.serve.live import Server

pytestmark = pytest.mark.slow  # the prepared SmolLM2 (tests/conftest.py smollm2_dir)
openai = pytest.importorskip("openai", reason="the server's tests need the openai client (requirements.txt)")


def test_smollm2_chat_stream_through_the_openai_client(smollm2_dir, tmp_path):
    question = "What is the capital of France?"
    with LLM("smollm2-135m", chat=True, gpu_batch_size=1, quiet=True, offload_dir=str(tmp_path)) as llm:
        want = llm.generate(question, 6, stop="eos")[0].text
    s = Server(["--model", "smollm2-135m", "--gpu-batch-size", "1"], tmp_path)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.chat.completions.create(model="smollm2-135m", stream=True, max_tokens=6, temperature=0,
                                                messages=[{"role": "user", "content": question}])
        got = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert got == want and "Paris" in got
    finally:
        assert s.stop() == 0
