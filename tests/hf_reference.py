"""HF transformers as the reference: greedy generation with left padding, as the engine pads."""
import torch


def hf_generate(model, prompts, n: int, pad: int):
    """(tokens [B][n], logits [n, B, V] float32) from HF generate on left-padded prompts."""
    plen = max(map(len, prompts))
    ids = torch.tensor([[pad] * (plen - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (plen - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=pad)
    return out.sequences[:, plen:].tolist(), torch.stack(out.logits).float()
