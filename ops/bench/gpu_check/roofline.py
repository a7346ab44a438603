"""The roofline: a lower bound on an offline workload's time from a model's shape and the two
measured ceilings, the copy bandwidth and the matmul rate (arithmetic only)."""


def model_shape(config: dict) -> dict:
    heads = config["num_attention_heads"]
    return dict(hidden=config["hidden_size"], inter=config["intermediate_size"],
                layers=config["num_hidden_layers"], heads=heads,
                kv_heads=config.get("num_key_value_heads", heads),
                head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                vocab=config["vocab_size"])


def matmul_params(s: dict) -> int:
    """Weights every token multiplies by: the layers' projections and the LM head."""
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    per_layer = s["hidden"] * (q + 2 * kv) + q * s["hidden"] + 3 * s["hidden"] * s["inter"]
    return s["layers"] * per_layer + s["hidden"] * s["vocab"]


def kv_bytes_per_token(s: dict, elt: int) -> int:
    return s["layers"] * 2 * s["kv_heads"] * s["head_dim"] * elt


def roofline_seconds(s: dict, num_prompts: int, input_len: int, output_len: int,
                     max_num_seqs: int, bytes_per_s: float, flop_per_s: float,
                     elt: int = 2) -> float:
    """A lower bound on the workload's time at the two measured ceilings:
    - prefill: every prompt token's matmul FLOPs plus causal attention's, at the matmul rate
      (or the K/V it writes at the copy bandwidth, were that longer);
    - decode: waves of max_num_seqs sequences; each step reads every weight once and each
      sequence's K/V, and does 2 FLOPs per weight and 4 * head_dim per attended key and head
      per sequence; the step takes the longer of its bytes at the copy bandwidth and its FLOPs
      at the matmul rate. The first output token comes from the prefill.
    Perfect batching, no host time, no prefill/decode overlap."""
    token_flops = 2 * matmul_params(s)
    pair_flops = 4 * s["layers"] * s["heads"] * s["head_dim"]
    kv_token = kv_bytes_per_token(s, elt)
    weight_bytes = matmul_params(s) * elt
    prefill_flops = num_prompts * (input_len * token_flops
                                   + pair_flops * input_len * (input_len + 1) / 2)
    seconds = max(prefill_flops / flop_per_s, num_prompts * input_len * kv_token / bytes_per_s)
    left = num_prompts
    while left > 0:
        batch = min(left, max_num_seqs)
        left -= batch
        for step in range(1, output_len):
            context = input_len + step
            step_bytes = weight_bytes + batch * context * kv_token
            step_flops = batch * (token_flops + pair_flops * context)
            seconds += max(step_bytes / bytes_per_s, step_flops / flop_per_s)
    return seconds
