"""Turn --prompt / --prompt-file / --prompt-ids-file (or nothing, as FlexGen) into token ids."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import ConfigError

FLEXGEN_PROMPT = "Paris is the capital city of"


def load_tokenizer(tokenizer_dir):
    if tokenizer_dir is None:
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except Exception as e:  # a damaged tokenizer.json fails in many ways, all meaning the same
        raise ConfigError(f"{tokenizer_dir}: cannot load its tokenizer ({type(e).__name__}: {e})") from None


def build_prompts(run, tokenizer, batch_size: int, vocab: int) -> list[list[int]]:
    """One id list per sequence: the prompts given, or FlexGen's benchmark prompt repeated over the batch."""
    if run.prompt_ids_file:
        try:
            ids = json.loads(Path(run.prompt_ids_file).read_text())
        except OSError as e:
            raise ConfigError(f"--prompt-ids-file {run.prompt_ids_file}: {e.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"--prompt-ids-file {run.prompt_ids_file}: not JSON ({e})") from None
        if not (isinstance(ids, list) and ids and all(isinstance(s, list) and is_token_ids(s, vocab) for s in ids)):
            raise ConfigError(f"--prompt-ids-file must hold a JSON list of non-empty lists of token ids in [0, {vocab})")
        return _fill(ids, batch_size)
    text = run.prompt
    if run.prompt_file:
        try:
            text = Path(run.prompt_file).read_text()
        except OSError as e:
            raise ConfigError(f"--prompt-file: {e.strerror}: {run.prompt_file}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"--prompt-file {run.prompt_file} is not UTF-8 text (byte {e.object[e.start]:#04x} "
                              f"at offset {e.start}); give a text file") from None
    if text is not None:
        return _fill([text_ids(tokenizer, text, run.chat, vocab)], batch_size)
    if tokenizer is not None:  # FlexGen's benchmark prompt (the engine left-pads it to --prompt-len)
        return _fill([encode(tokenizer, FLEXGEN_PROMPT, run.chat)[-run.prompt_len:]], batch_size, given=False)
    g = torch.Generator().manual_seed(run.seed)  # no tokenizer (dummy OPT): fixed random ids
    return _fill([torch.randint(3, vocab, (run.prompt_len,), generator=g).tolist()], batch_size, given=False)


def text_ids(tokenizer, text: str, chat: bool, vocab: int, ids_flag: str = "--prompt-ids-file") -> list[int]:
    """A prompt text's token ids, checked: not empty, inside the model's vocabulary."""
    if tokenizer is None:
        raise ConfigError(f"this model has no tokenizer: give token ids with {ids_flag}")
    ids = encode(tokenizer, text, chat)
    if not ids:
        raise ConfigError("the prompt is empty: it encodes to no tokens")
    if max(ids) >= vocab:  # a tokenizer whose added tokens the model's embedding lacks
        raise ConfigError(f"the prompt encodes to token {max(ids)}, outside the model's vocabulary [0, {vocab})")
    return ids


def is_token_ids(seq, vocab: int) -> bool:
    """A non-empty list of token ids in [0, vocab)."""
    return isinstance(seq, (list, tuple)) and len(seq) > 0 and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in seq)


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    if chat and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("--chat: this model's tokenizer has no chat template")
    with _quiet_tokenizer():  # a prompt longer than the model's table is the engine's own one-line error
        if chat:
            out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
        return tokenizer(text)["input_ids"]


@contextmanager
def _quiet_tokenizer():
    """transformers' tokenizer warnings ("Token indices sequence length is longer than ...") held
    back: what they warn of, the engine checks and says in its own words."""
    from transformers.utils import logging as hf_logging
    log = hf_logging.get_logger("transformers.tokenization_utils_base")
    level = log.level
    log.setLevel(hf_logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _fill(ids: list[list[int]], batch_size: int, given: bool = True) -> list[list[int]]:
    """The prompts a run computes: the ones given, as a batch of their own (fewer than the batch
    size is a smaller batch: one prompt, one answer); FlexGen's benchmark prompt (none given) is
    repeated over the batch, as FlexGen does."""
    if not given:
        return ids * batch_size
    if len(ids) > batch_size:
        raise ConfigError(f"{len(ids)} prompts given but the batch is {batch_size} "
                          "(--gpu-batch-size x --num-gpu-batches); `flexgen-sparpr batch` runs any number")
    return ids
