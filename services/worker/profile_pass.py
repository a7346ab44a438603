"""The memory profile's forward pass: a model's largest step, with no KV cache."""
import torch

from services.worker.attention import AttentionMetadata


def profile_forward(model, num_tokens: int, num_sampled_rows: int, device: torch.device,
                    block_size: int) -> torch.Tensor | None:
    """One forward pass of `num_tokens` prompt tokens (at least 2) as one sequence, no cache
    -> the logits of its last `num_sampled_rows` positions (None on a tensor-parallel
    follower, which gets none)."""
    num_tokens = max(2, num_tokens)
    num_sampled_rows = max(1, min(num_sampled_rows, num_tokens))
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    z = torch.zeros(1, dtype=torch.long, device=device)
    meta = AttentionMetadata(
        num_prefills=1, num_prefill_tokens=num_tokens, num_decode_tokens=0,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.long, device=device),
        query_start_loc=torch.tensor([0, num_tokens], device=device),
        seq_lens=z + num_tokens, context_lens=z, block_tables=z.view(1, 1),
        max_query_len=num_tokens, max_seq_len=num_tokens, block_size=block_size,
        seq_lens_list=[num_tokens], query_lens_list=[num_tokens])
    hidden = model(input_ids, positions, None, meta)
    return model.compute_logits(hidden[-num_sampled_rows:])
