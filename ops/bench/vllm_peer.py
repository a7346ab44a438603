"""The throughput workload on vLLM's offline `LLM`, run by vLLM's own Python (its own venv).

`pagoda bench throughput --baseline vllm --vllm-python VENV/bin/python` starts this file with
that interpreter and keeps it running, so that its runs alternate with pagoda's. The job comes as
one JSON line on stdin (model, settings, warm-up prompts, and `reply_fd`: a pipe this process
was given); vLLM starts, and one JSON line goes back on the pipe. Then each line on stdin holds
a workload's prompts (`{"prompts": [[token ids], ...]}`) and is answered on the pipe with its time and token count; stdin's
end stops it. vLLM logs to stdout and stderr, which stay the terminal's, so whatever stops it is
on screen. It imports nothing of pagoda's, so it runs wherever vLLM is installed.
"""
import json
import os
import sys
import time


def die_with_parent() -> None:
    """SIGKILL when the benchmark's process dies, even while stopped between its runs (Linux)."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def main() -> None:
    die_with_parent()
    # Python put this script's folder first on the path, where ops/bench/kernels.py would
    # pass for a package named `kernels` (transformers probes for one): drop it.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    job = json.loads(sys.stdin.readline())
    reply = os.fdopen(job["reply_fd"], "w", buffering=1)
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    sized = ({"kv_cache_memory_bytes": job["kv_cache_memory_bytes"]}
             if job.get("kv_cache_memory_bytes") else {})
    llm = LLM(model=job["model"], dtype=job["dtype"], seed=0,
              max_model_len=job["max_model_len"], max_num_seqs=job["max_num_seqs"],
              gpu_memory_utilization=job["memory_fraction"], **sized)
    startup = time.perf_counter() - t0
    params = SamplingParams(max_tokens=job["output_len"], ignore_eos=True, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["warmup"]],
                 SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    reply.write(json.dumps({"startup_s": startup, "version": vllm.__version__,
                            "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                            "memory_fraction": job["memory_fraction"],
                            "kv_cache_memory_bytes": job.get("kv_cache_memory_bytes")}) + "\n")
    for line in sys.stdin:
        prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(line)["prompts"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        reply.write(json.dumps({"seconds": seconds, "output_tokens": sum(
            len(o.outputs[0].token_ids) for o in outputs)}) + "\n")


if __name__ == "__main__":
    main()
