"""A benchmark's prompts on llama.cpp (llama-cpp-python), run by that venv's own Python.

`pagoda bench latency --baseline llama.cpp --llama-cpp-python VENV/bin/python --gguf FILE`
starts this file with that interpreter and keeps it running, so that its runs alternate with
pagoda's. The same protocol as ops/bench/vllm_peer.py: the job comes as one JSON line on stdin
(GGUF path, output length, context size, threads, and `reply_fd`: a pipe this process was
given); llama.cpp loads, and one JSON line goes back on the pipe. Each line on stdin then holds
prompts (`{"prompts": [[token ids], ...]}`), run one after the other, each alone and greedy, for
exactly the output length (end-of-text does not stop it), and is answered on the pipe with the
time and token count. It imports nothing of pagoda's.
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


def generate(llm, prompt: list[int], n: int) -> float:
    """n greedy tokens after `prompt` -> seconds to the first one. `Llama.generate` yields
    token after token until its caller stops: it does not stop at end-of-text itself."""
    start = time.perf_counter()
    first = None
    for i, _ in enumerate(llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=True)):
        if first is None:
            first = time.perf_counter() - start
        if i + 1 == n:
            break
    return first or 0.0


def main() -> None:
    die_with_parent()
    # Python put this script's folder first on the path, where ops/bench/kernels.py would
    # pass for a package named `kernels` (transformers probes for one): drop it.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    job = json.loads(sys.stdin.readline())
    reply = os.fdopen(job["reply_fd"], "w", buffering=1)
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=job["model"], n_ctx=job["n_ctx"], n_batch=512,
                          n_threads=job["n_threads"], n_threads_batch=job["n_threads"],
                          seed=0, verbose=False)
    startup = time.perf_counter() - t0
    generate(llm, [1, 2, 3, 4], 2)  # warm-up
    reply.write(json.dumps({"startup_s": startup, "version": llama_cpp.__version__,
                            "n_threads": job["n_threads"],
                            "system_info": llama_cpp.llama_print_system_info().decode()}) + "\n")
    for line in sys.stdin:
        prompts = json.loads(line)["prompts"]
        start = time.perf_counter()
        firsts = [generate(llm, p, job["output_len"]) for p in prompts]
        seconds = time.perf_counter() - start
        reply.write(json.dumps({"seconds": seconds, "output_tokens": job["output_len"] * len(prompts),
                                "first_token_s": firsts}) + "\n")


if __name__ == "__main__":
    main()
