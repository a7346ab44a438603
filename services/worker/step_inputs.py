"""One step's model inputs from its rows: token ids, positions and the attention metadata
(slots, block tables, lengths) of the flat token layout.

A decode's token may still be on the device: the step before sampled it and has not been read
back (ModelRunner.launch runs a step before the previous one is finished). Such a token is
PLACEHOLDER in the sequence's `token_ids`, and `state.pending_tokens[position]` names the
sampled-token tensor and row it is in; it is gathered into `input_ids` on the device, in stream
order after the step that samples it, so the host never waits for it.
"""
import numpy as np
import torch

from proto.messages import PLACEHOLDER
from services.worker.attention import AttentionMetadata
from services.worker.staging import StagingBuffer


def prepare_inputs(rows, block_size: int, staging: StagingBuffer | None,
                   extra: dict[str, np.ndarray] | None = None):
    """rows (ModelRunner's: `start`, `num_tokens`, `state.token_ids`, `state.block_table`, in
    the step's order: prefills first, as ModelRunner._plan_rows puts them) -> (input_ids [T],
    positions [T], AttentionMetadata, `extra` as tensors by name). `extra`: other arrays of
    the step (its sampling parameters) to cross with these. With `staging` (a GPU) every array
    crosses in one copy; on the CPU they are wrapped without one."""
    bs = block_size
    # Decode tokens still on the device, by the tensor that holds them: (tensor, [index into
    # this step's input_ids], [row of that tensor]).
    fills: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    num_prefills = sum(1 for r in rows if r.num_tokens > 1)
    tokens, positions, slots = [], [], []
    seq_lens, query_lens = [], []
    max_blocks = 0
    for row in rows:
        end = row.start + row.num_tokens
        table = row.state.block_table
        assert (end + bs - 1) // bs <= len(table), f"seq {row.seq.seq_id}: block table too short"
        if row.num_tokens == 1:
            token = row.state.token_ids[row.start]
            if token == PLACEHOLDER:
                source, index = row.state.pending_tokens[row.start]
                fill = fills.setdefault(id(source), (source, [], []))
                fill[1].append(len(tokens))
                fill[2].append(index)
            tokens.append(token)
            positions.append(row.start)
            slots.append(table[row.start // bs] * bs + row.start % bs)
        else:
            pos = np.arange(row.start, end)
            chunk = row.state.token_ids[row.start:end]
            # Only a decode follows a step still running (ModelRunner.can_launch_ahead).
            assert PLACEHOLDER not in chunk, f"seq {row.seq.seq_id}: a chunk with unknown tokens"
            tokens.extend(chunk)
            positions.append(pos)
            slots.append(np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs)
        seq_lens.append(end)
        query_lens.append(row.num_tokens)
        max_blocks = max(max_blocks, (end + bs - 1) // bs)
    block_tables = np.zeros((len(rows), max_blocks), dtype=np.int64)
    for i, row in enumerate(rows):
        n = (seq_lens[i] + bs - 1) // bs
        block_tables[i, :n] = row.state.block_table[:n]
    positions = np.concatenate([np.atleast_1d(p) for p in positions]).astype(np.int64)
    slots = np.concatenate([np.atleast_1d(s) for s in slots]).astype(np.int64)
    query_start = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start[1:])
    seq_lens_np = np.asarray(seq_lens, dtype=np.int64)
    num_prefill_tokens = int(query_start[num_prefills])
    arrays = {"input_ids": np.asarray(tokens, dtype=np.int64), "positions": positions,
              "slot_mapping": slots, "query_start_loc": query_start,
              "seq_lens": seq_lens_np, "context_lens": seq_lens_np - np.asarray(query_lens),
              "block_tables": block_tables}
    for name, array in (extra or {}).items():
        arrays[f"extra_{name}"] = array
    for k, (_, into, rows_of) in enumerate(fills.values()):
        arrays[f"fill_into_{k}"] = np.asarray(into, dtype=np.int64)
        arrays[f"fill_from_{k}"] = np.asarray(rows_of, dtype=np.int64)
    if staging is not None:
        t = staging.transfer(arrays)  # one copy for all of them
    else:
        t = {name: torch.from_numpy(a) for name, a in arrays.items()}  # no copy at all
    for k, (source, _, _) in enumerate(fills.values()):
        t["input_ids"].index_copy_(0, t[f"fill_into_{k}"],
                                   source.index_select(0, t[f"fill_from_{k}"]).long())
    meta = AttentionMetadata(
        num_prefills=num_prefills,
        num_prefill_tokens=num_prefill_tokens,
        num_decode_tokens=len(tokens) - num_prefill_tokens,
        slot_mapping=t["slot_mapping"],
        query_start_loc=t["query_start_loc"],
        seq_lens=t["seq_lens"],
        context_lens=t["context_lens"],
        block_tables=t["block_tables"],
        max_query_len=max([q for q in query_lens if q > 1], default=1),
        max_seq_len=max(seq_lens),
        block_size=bs,
        seq_lens_list=seq_lens,
        query_lens_list=query_lens,
    )
    return (t["input_ids"], t["positions"], meta,
            {name: t[f"extra_{name}"] for name in (extra or {})})
