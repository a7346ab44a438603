"""The top-k / top-p kernel (pagoda_kernels/triton/top_k_top_p.py) in the kernels section: against its
torch reference on the device, then timed against the sampler's sort path, what CUDA ran
before it (a full sort of every row)."""
from .kernel_timing import median_seconds
from .measure import device_generator
from .report import Row, Run, log

P_TOLERANCE = 1e-5  # a logit whose mass above lies this close to p may land on either side


def filter_inputs(run: Run, device, num_rows: int, seed: int):
    """Logits of the default vocabulary's scale, k and p varied per row (some rows unlimited)."""
    import torch
    p = run.plan
    g = device_generator(device, seed)
    x = torch.randn(num_rows, p.sampling_vocab, generator=g, device=device) * 3
    ks = torch.tensor([50, p.sampling_vocab, 1, 1000, 20], device=device)
    ps = torch.tensor([0.9, 0.95, float("inf"), 0.5, 1.0], device=device)
    rows = torch.arange(num_rows, device=device)
    return x, ks[rows % len(ks)], ps[rows % len(ps)]


def check_top_k_top_p(run: Run, device, dtype=None) -> Row:
    import torch
    from pagoda_kernels.triton.top_k_top_p import top_k_top_p, top_k_top_p_reference
    num_rows = max(run.plan.sampling_batches)
    x, top_k, top_p = filter_inputs(run, device, num_rows, seed=8)
    x[1::4] = (x[1::4] * 2).round() / 2  # tie groups at the edges on some rows
    out = torch.full_like(x, float("nan"))
    top_k_top_p(x, top_k, top_p, out=out)
    expected = top_k_top_p_reference(x, top_k, top_p)
    written = not torch.isnan(out).any().item()
    rows, cols = out.ne(expected).nonzero(as_tuple=True)
    near = 0.0
    if len(rows):
        # The mass above each differing logit, in the distribution top-p saw (after top-k).
        kept = top_k_top_p_reference(x, top_k, None).double()
        probs = kept.softmax(dim=-1)
        pairs = list(zip(rows.tolist(), cols.tolist()))[:1000]  # enough to judge by
        above = torch.stack([(probs[r] * (kept[r] > kept[r, c])).sum() for r, c in pairs])
        near = (above - top_p.double()[rows[:len(pairs)]]).abs().max().item()
    ok = written and near < P_TOLERANCE
    result = (f"{len(rows)} of {x.numel()} values differ from the reference"
              + (f" (mass above within {near:.1e} of p)" if len(rows) else "")
              + ("" if written else ", NaN left in the output")
              + f" ({num_rows} rows x {run.plan.sampling_vocab}, k and p per row, ties)")
    log(run, f"kernels: top_k_top_p check: {result}")
    return Row("kernels", "top_k_top_p: correctness", result,
               f"equal, except within {P_TOLERANCE:g} of a top-p edge", "ok" if ok else "MISMATCH")


def time_top_k_top_p(run: Run, device, dtype, raw: dict) -> list:
    import torch
    from pagoda_kernels.triton.top_k_top_p import top_k_top_p
    from services.worker.sampler import _top_k_top_p_by_sort
    p = run.plan
    rows, raw["top_k_top_p"] = [], []
    for num_rows in p.sampling_batches:
        x, top_k, top_p = filter_inputs(run, device, num_rows, seed=9)
        out = torch.empty_like(x)
        kernel_s = median_seconds(lambda: top_k_top_p(x, top_k, top_p, out=out), device,
                                  p.timing_iters, p.warmup)
        sort_s = median_seconds(lambda: _top_k_top_p_by_sort(x, top_k, top_p), device,
                                p.timing_iters, p.warmup)
        raw["top_k_top_p"].append(dict(rows=num_rows, vocab=p.sampling_vocab,
                                       kernel_seconds=kernel_s, sort_seconds=sort_s))
        result = (f"{kernel_s * 1e6:,.1f} us, the sort path {sort_s * 1e6:,.1f} us: "
                  f"{sort_s / kernel_s:.2f}x")
        log(run, f"kernels: top_k_top_p at {num_rows} rows: {result}")
        rows.append(Row("kernels", f"top_k_top_p, {num_rows} x {p.sampling_vocab}", result))
    return rows
