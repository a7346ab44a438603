"""Per-request edits of the logits before sampling: logit_bias and allowed_token_ids.

Each is applied in one indexed operation over the (row, token) pairs of the rows that ask for
it; only those pairs cross to the device.
"""
import torch

from shared.sampling_params import SamplingParams


def apply_allowed_token_ids(logits: torch.Tensor, rows: list[int],
                            params: list[SamplingParams]) -> None:
    """logits[rows[i]] keeps only params[i].allowed_token_ids; every other id becomes -inf."""
    pair_rows, pair_ids = [], []
    for local, p in enumerate(params):
        pair_rows += [local] * len(p.allowed_token_ids)
        pair_ids += p.allowed_token_ids
    device = logits.device
    allowed = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool, device=device)
    allowed[torch.tensor(pair_rows, device=device), torch.tensor(pair_ids, device=device)] = True
    index = torch.tensor(rows, device=device)
    logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, rows: list[int], params: list[SamplingParams]) -> None:
    """Add params[i].logit_bias (token id -> bias, clamped to [-100, 100]) to logits[rows[i]]."""
    pair_rows, pair_ids, biases = [], [], []
    for row, p in zip(rows, params):
        pair_rows += [row] * len(p.logit_bias)
        pair_ids += p.logit_bias.keys()
        biases += p.logit_bias.values()
    device = logits.device
    values = torch.tensor(biases, dtype=torch.float32).clamp_(-100.0, 100.0)
    logits.index_put_((torch.tensor(pair_rows, device=device),
                       torch.tensor(pair_ids, device=device)),
                      values.to(device=device, dtype=logits.dtype), accumulate=True)


def allows_other_than(row: torch.Tensor, token_ids: set[int]) -> bool:
    """Whether logits `row` leave any token other than `token_ids` above -inf (a host sync:
    only for rows with logit edits before their min_tokens)."""
    allowed = row > float("-inf")
    allowed[list(token_ids)] = False
    return bool(allowed.any())
