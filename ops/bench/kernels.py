"""Per-op decode-step cost: the CPU kernels (pagoda_kernels/cpu, packed weights) against the torch ops.

One decode step of the default model's shapes at `--batch` sequences of `--context` tokens,
op by op, each with a buffer per layer so that weights and KV caches come from memory as in a
real step. Both sides run in the same process, alternately, and the ratio is torch / kernels.
"""
import argparse
import json

import torch
import torch.nn.functional as F

from ops.bench.timing import best_seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=64, help="decoding sequences")
    parser.add_argument("--context", type=int, default=192, help="tokens per sequence")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=None, help="take the shapes from this model")
    parser.add_argument("--output-json", default=None)


def _cases(hf, dtype: torch.dtype, batch: int, context: int, block_size: int) -> dict:
    """name -> (torch op over all layers, kernel op over all layers)."""
    from pagoda_kernels import cpu
    from pagoda_kernels.reference import paged_decode_attention
    from services.worker.models.linear import Linear, SiluAndMulLinear, pack_weight

    layers = hf.num_hidden_layers
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    hidden, inter, vocab = hf.hidden_size, hf.intermediate_size, hf.vocab_size
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).to(dtype)

    # Attention: a cache per layer, blocks handed out in order as the block manager does.
    num_blocks = -(-context // block_size)
    caches = [(randn(batch * num_blocks + 1, block_size, kv_heads, head_dim),
               randn(batch * num_blocks + 1, block_size, kv_heads, head_dim))
              for _ in range(layers)]
    tables = torch.arange(1, batch * num_blocks + 1).view(batch, num_blocks)
    seq_lens = torch.full((batch,), context)
    query = randn(batch, heads, head_dim)
    scale = head_dim ** -0.5

    def attention(op):
        return lambda: [op(query, k, v, tables, seq_lens, context, scale) for k, v in caches]

    # Element-wise ops, as a step calls them.
    x, res, w = randn(batch, hidden), randn(batch, hidden), randn(hidden)
    qk = randn(batch, heads + kv_heads, head_dim)
    cos_sin = randn(4096, 2, head_dim)
    positions = torch.full((batch,), context - 1)
    cos, sin = cos_sin.index_select(0, positions).unsqueeze(1).unbind(2)

    def torch_norms():
        for _ in range(2 * layers):
            F.rms_norm(x + res, (hidden,), w, 1e-5)

    def kernel_norms():
        for _ in range(2 * layers):
            cpu.rms_norm(x, w, 1e-5, res.clone())

    def torch_rotary():
        for _ in range(layers):
            torch.addcmul(qk * cos, qk.roll(head_dim // 2, dims=-1), sin)

    def kernel_rotary():
        for _ in range(layers):
            cpu.rotary_(qk, positions, cos_sin)

    # Matmuls: each layer's four weights (SiLU * up after gate/up) and the LM head, as loaded vs
    # prepared.
    shapes = [(heads * head_dim + 2 * kv_heads * head_dim, hidden), (hidden, heads * head_dim),
              (2 * inter, hidden), (hidden, inter)]
    weights = [[randn(*s) for s in shapes] for _ in range(layers)]
    head = randn(vocab, hidden)
    # As the model's modules hold them (Linear.pack: the layout this CPU runs fastest, the
    # gate/up weight with SiLU * up fused where the kernel has it; modules that do not fuse it
    # apply it after the matmul, so the torch side does too).
    def module(w: torch.Tensor, gate_up: bool = False) -> Linear:
        m = (SiluAndMulLinear if gate_up else Linear)(w.shape[1], w.shape[0], False, dtype)
        m.weight.data.copy_(w)
        m.pack()
        return m
    modules = [[module(w, gate_up=i == 2) for i, w in enumerate(layer)] for layer in weights]
    head_packed = pack_weight(head, (torch.bfloat16, torch.float32))
    inputs = {hidden: randn(batch, hidden), heads * head_dim: randn(batch, heads * head_dim),
              inter: randn(batch, inter)}

    def torch_matmuls():
        for layer in weights:
            for i, w in enumerate(layer):
                y = F.linear(inputs[w.shape[1]], w)
                if i == 2:
                    gate, up = y.chunk(2, dim=-1)
                    F.silu(gate) * up
        F.linear(inputs[hidden], head)

    def kernel_matmuls():
        from services.worker.models.linear import linear
        for layer in modules:
            for m in layer:
                m(inputs[m.weight.shape[1]])
        linear(inputs[hidden], head, None, head_packed)

    logits = randn(batch, vocab)

    def torch_greedy():
        scores = logits.float()
        ids = scores.argmax(-1)
        scores.gather(1, ids[:, None]) - torch.logsumexp(scores, -1, keepdim=True)

    return {
        "decode attention": (attention(paged_decode_attention),
                             attention(cpu.paged_decode_attention)),
        "residual + RMSNorm": (torch_norms, kernel_norms),
        "rotary": (torch_rotary, kernel_rotary),
        "matmuls (layers + LM head)": (torch_matmuls, kernel_matmuls),
        "greedy sampling": (torch_greedy, lambda: cpu.greedy_sample(logits)),
    }


def run(args: argparse.Namespace) -> int:
    from pagoda_kernels import cpu
    from shared.engine_args import EngineArgs

    if cpu.load() is None:
        raise SystemExit(f"the CPU kernels are unavailable: {cpu.unavailable_reason()}")
    hf = EngineArgs(model=args.model).create_engine_config().model_config.hf_config
    print(f"one decode step: {hf.num_hidden_layers} layers, batch {args.batch}, context "
          f"{args.context}, {torch.get_num_threads()} threads; best of {args.repeats} (ms)")
    results = []
    with torch.inference_mode():
        for name in args.dtype:
            dtype = getattr(torch, name)
            total_torch = total_kernels = 0.0
            print(f"\n{name:10s} {'op':28s} {'torch':>9s} {'kernels':>9s} {'ratio':>7s}")
            for op, (torch_fn, kernel_fn) in _cases(hf, dtype, args.batch, args.context,
                                                      args.block_size).items():
                t_torch = 1e3 * best_seconds(torch_fn, args.repeats)
                t_kernel = 1e3 * best_seconds(kernel_fn, args.repeats)
                total_torch += t_torch
                total_kernels += t_kernel
                print(f"{'':10s} {op:28s} {t_torch:9.2f} {t_kernel:9.2f} "
                      f"{t_torch / t_kernel:6.2f}x")
                results.append({"dtype": name, "op": op, "torch_ms": t_torch,
                                "kernels_ms": t_kernel})
            print(f"{'':10s} {'all of the above':28s} {total_torch:9.2f} {total_kernels:9.2f} "
                  f"{total_torch / total_kernels:6.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"batch": args.batch, "context": args.context,
                       "threads": torch.get_num_threads(), "results": results}, f, indent=1)
        print(f"saved {args.output_json}")
    return 0
