"""Top-k and top-p filtering of sampling logits without sorting the vocabulary, as a Triton
kernel, beside the torch reference it is tested against (`top_k_top_p_reference`, the same
signature).

x       [N, V] float32, each row contiguous (temperature-scaled logits)
top_k   [N] int64 or None: keep the k largest; k >= V (or None) = no limit
top_p   [N] float32 or None: keep the smallest top set whose probability reaches p, in the
        distribution left after top-k; p >= 1 (or +inf, or None) = no limit
out     [N, V] float32: x where kept, -inf elsewhere (x itself may be passed: in place)

What is kept, exactly: top-k keeps every logit >= the row's k-th largest (ties at the edge
kept, as torch.topk's k-th value gives); top-p then keeps a logit while the mass of the logits
strictly above it, among those top-k kept, is below p (the largest always stays; a tie group at
the edge is kept or dropped whole). The sampler's sort path on the CPU agrees except where its
sort happens to split a tie group at the top-p edge.

How (one program per row, the row read from L2 pass after pass, never sorted): logits are
mapped to int32 keys of the same order (the float's bits, negatives with the magnitude bits
flipped and -0 joined to 0), so that a threshold is found exactly by a search over the
integers between the row's smallest and largest key; each pass tests 16 evenly spaced pivots
at once, so the range shrinks 16-fold a pass and 8 passes cover 2**32 keys:
  top-k: the largest key t with count(key >= t) >= k, which is the k-th largest logit;
  top-p: the smallest key t with sum(exp(x - max) over keys > t, top-k kept) < p * Z, Z the
         sum over all top-k kept; every logit with a key >= t is kept.
One pass before finds the row's range, one between sums Z, a last one writes the mask: about 20
passes with both filters. Rows without a limit skip their search.
"""
import torch
import triton
import triton.language as tl

_MAX_BLOCK = 1024  # lanes per pass; each holds SPLITS comparisons of its logit
_SPLITS = 16  # pivots per pass of a threshold search: 2**32 keys in 8 passes


@triton.jit
def _order_key(x):
    """float32 -> int32 with the same order (as signed integers): -inf < ... < -0 == 0 < +inf
    (negatives: the magnitude bits flipped, then one up, so that -0 and 0 tie as they compare)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, (bits ^ 0x7FFFFFFF) + 1)


@triton.jit
def _top_k_top_p_kernel(x_ptr, out_ptr, top_k_ptr, top_p_ptr, vocab_size, x_stride, out_stride,
                        HAS_TOP_K: tl.constexpr, HAS_TOP_P: tl.constexpr, BLOCK: tl.constexpr,
                        SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    cols = tl.arange(0, BLOCK)
    splits = tl.arange(0, SPLITS).to(tl.int64)
    int32_min = -2147483648
    int32_max = 2147483647

    # Pass 1: the row's smallest and largest keys.
    lo_acc = tl.full([BLOCK], int32_max, tl.int32)
    hi_acc = tl.full([BLOCK], int32_min, tl.int32)
    for start in range(0, vocab_size, BLOCK):
        mask = start + cols < vocab_size
        key = _order_key(tl.load(x_row + start + cols, mask=mask, other=0.0))
        lo_acc = tl.minimum(lo_acc, tl.where(mask, key, int32_max))
        hi_acc = tl.maximum(hi_acc, tl.where(mask, key, int32_min))
    key_min = tl.min(lo_acc, axis=0).to(tl.int64)
    key_max = tl.max(hi_acc, axis=0).to(tl.int64)

    # Top-k: the largest t in [key_min, key_max] with count(key >= t) >= k. Each pass counts at
    # SPLITS evenly spaced pivots lo + j * step (pivot 0 = lo keeps count >= k) and keeps the
    # stretch after the last pivot that still counts k: the range shrinks SPLITS-fold a pass.
    kth = key_min
    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row)
        if k < vocab_size:
            lo = key_min
            hi = key_max
            while lo < hi:
                step = (hi - lo + SPLITS) // SPLITS  # ceil((hi - lo + 1) / SPLITS)
                pivots = lo + splits * step
                valid = pivots <= hi
                # Compared in int32 (fewer registers): pivots past hi are clamped, and ignored.
                pivots32 = tl.minimum(pivots, hi).to(tl.int32)
                count = tl.zeros([SPLITS], tl.int32)
                for start in range(0, vocab_size, BLOCK):
                    mask = start + cols < vocab_size
                    key = _order_key(tl.load(x_row + start + cols, mask=mask, other=0.0))
                    above = mask[None, :] & (key[None, :] >= pivots32[:, None])
                    count += tl.sum(above.to(tl.int32), axis=1)
                # Counts fall as the pivots rise: the pivots that still count k come first.
                last = tl.sum((valid & (count >= k)).to(tl.int64), axis=0) - 1
                lo = lo + last * step
                hi = tl.minimum(hi, lo + step - 1)
            kth = lo

    threshold = kth
    if HAS_TOP_P:
        p = tl.load(top_p_ptr + row)
        if p < 1.0:
            # The row's largest logit, back from its key (its exp is 1: nothing overflows).
            x_max_bits = tl.where(key_max >= 0, key_max, (key_max - 1) ^ 0x7FFFFFFF).to(tl.int32)
            x_max = x_max_bits.to(tl.float32, bitcast=True)
            total = tl.zeros([BLOCK], tl.float32)
            for start in range(0, vocab_size, BLOCK):
                mask = start + cols < vocab_size
                x = tl.load(x_row + start + cols, mask=mask, other=float("-inf"))
                kept = mask & (_order_key(x).to(tl.int64) >= kth)
                total += tl.where(kept, tl.exp(x - x_max), 0.0)
            target = p * tl.sum(total, axis=0)
            # The smallest t in [kth, key_max] whose mass strictly above (among the top-k kept)
            # is below p * Z; at key_max the mass above is 0. The mass falls as t rises (sums
            # of fewer non-negative terms, rounded monotonically), so the pivots where it is
            # still >= the target come first, and the answer lies just past the last of them.
            lo = kth
            hi = key_max
            while lo < hi:
                step = (hi - lo + SPLITS) // SPLITS
                pivots = lo + splits * step
                valid = pivots <= hi
                pivots32 = tl.minimum(pivots, hi).to(tl.int32)
                mass = tl.zeros([SPLITS], tl.float32)
                for start in range(0, vocab_size, BLOCK):
                    mask = start + cols < vocab_size
                    x = tl.load(x_row + start + cols, mask=mask, other=float("-inf"))
                    key = _order_key(x)
                    e = tl.where(mask & (key.to(tl.int64) >= kth), tl.exp(x - x_max), 0.0)
                    mass += tl.sum(tl.where(key[None, :] > pivots32[:, None], e[None, :], 0.0),
                                   axis=1)
                reach = tl.sum((valid & (mass >= target)).to(tl.int64), axis=0)
                if reach == 0:
                    hi = lo  # the mass above lo is below the target already
                else:
                    num_valid = tl.sum(valid.to(tl.int64), axis=0)
                    new_lo = lo + (reach - 1) * step + 1
                    if reach < num_valid:
                        hi = lo + reach * step
                    lo = new_lo
            threshold = lo

    # Last pass: the mask (in place is safe: each element is read and written by one lane).
    out_row = out_ptr + row * out_stride
    for start in range(0, vocab_size, BLOCK):
        mask = start + cols < vocab_size
        x = tl.load(x_row + start + cols, mask=mask, other=0.0)
        keep = _order_key(x).to(tl.int64) >= threshold
        tl.store(out_row + start + cols, tl.where(keep, x, float("-inf")), mask=mask)


def _check(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"top_k_top_p: x must be [N, V] float32, got {x.dtype} "
                         f"{tuple(x.shape)}")
    for name, t, dtype in (("top_k", top_k, torch.int64), ("top_p", top_p, torch.float32)):
        if t is not None and (t.shape != (x.shape[0],) or t.dtype != dtype
                              or t.device != x.device):
            raise ValueError(f"top_k_top_p: {name} must be [{x.shape[0]}] {dtype} on "
                             f"{x.device}, got {tuple(t.shape)} {t.dtype} on {t.device}")


def top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                out: torch.Tensor | None = None, block: int | None = None) -> torch.Tensor:
    """x [N, V] -> out (a new tensor unless given; x itself is fine) with the logits the
    filters drop set to -inf. `block` (a power of two) is the lanes per pass, for tests."""
    _check(x, top_k, top_p)
    num_rows, vocab_size = x.shape
    if x.stride(1) != 1 and vocab_size > 1:
        raise ValueError(f"top_k_top_p: x's rows must be contiguous, got strides {x.stride()}")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out.shape != x.shape or out.dtype != x.dtype or (out.stride(1) != 1 and vocab_size > 1):
        raise ValueError(f"top_k_top_p: out must be {tuple(x.shape)} float32 with contiguous "
                         f"rows, got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if num_rows == 0 or vocab_size == 0:
        return out
    block = block or min(_MAX_BLOCK, triton.next_power_of_2(vocab_size))
    _top_k_top_p_kernel[(num_rows,)](
        x, out, top_k if top_k is not None else x, top_p if top_p is not None else x,
        vocab_size, x.stride(0), out.stride(0), HAS_TOP_K=top_k is not None,
        HAS_TOP_P=top_p is not None, BLOCK=block, SPLITS=_SPLITS,
        num_warps=8 if block >= 1024 else 4)
    return out


def top_k_top_p_reference(x: torch.Tensor, top_k: torch.Tensor | None,
                          top_p: torch.Tensor | None, out: torch.Tensor | None = None,
                          block: int | None = None) -> torch.Tensor:
    """What `top_k_top_p` computes, in torch with a full sort (`block` is ignored); the
    masses in float64, so that the reference is the exact side of a comparison."""
    _check(x, top_k, top_p)
    num_rows, vocab_size = x.shape
    keep = torch.ones_like(x, dtype=torch.bool)
    if num_rows and vocab_size:
        sorted_x = x.sort(dim=-1, descending=True).values  # [N, V]
        kth = torch.full((num_rows, 1), float("-inf"), device=x.device)
        if top_k is not None:
            limited = top_k < vocab_size
            index = (top_k.clamp(1, vocab_size) - 1)[:, None]
            kth = torch.where(limited[:, None], sorted_x.gather(1, index), kth)
        keep = x >= kth
        if top_p is not None:
            kept_sorted = sorted_x >= kth
            e = torch.where(kept_sorted, (sorted_x.double() - sorted_x[:, :1].double()).exp(),
                            0.0)
            exclusive = e.cumsum(dim=-1) - e  # mass ranked before each sorted position
            # A tie group's mass above is that before its first member.
            position = torch.arange(vocab_size, device=x.device).expand(num_rows, -1)
            starts = torch.ones_like(kept_sorted)
            starts[:, 1:] = sorted_x[:, 1:] != sorted_x[:, :-1]
            first = torch.where(starts, position, 0).cummax(dim=-1).values
            above = exclusive.gather(1, first) / e.sum(dim=-1, keepdim=True)
            limited = top_p < 1.0
            # The smallest kept sorted value: the threshold of the row.
            kept_p = kept_sorted & ((above < top_p.double()[:, None]) | ~limited[:, None])
            smallest = torch.where(kept_p, sorted_x, float("inf")).amin(dim=-1, keepdim=True)
            keep = x >= smallest
    result = x.masked_fill(~keep, float("-inf"))
    if out is None:
        return result
    return out.copy_(result)
