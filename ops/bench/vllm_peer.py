"""The throughput workload on vLLM's offline `LLM`, run by vLLM's own Python (its own venv).

`pagoda bench throughput --baseline vllm --vllm-python VENV/bin/python` starts this file with
that interpreter, writes the job as JSON on its stdin and reads the result from the file the job
names (`result_path`): vLLM logs to stdout and stderr, which stay the terminal's, so whatever
stops it is on screen. It imports nothing of pagoda's, so it runs wherever vLLM is installed.
"""
import json
import os
import sys
import time


def main() -> None:
    job = json.load(sys.stdin)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job["dtype"], seed=0,
              max_model_len=job["max_model_len"], max_num_seqs=job["max_num_seqs"],
              gpu_memory_utilization=job["memory_fraction"])
    startup = time.perf_counter() - t0
    params = SamplingParams(max_tokens=job["output_len"], ignore_eos=True, temperature=0.0)
    workloads = [[TokensPrompt(prompt_token_ids=p) for p in w] for w in job["workloads"]]
    llm.generate(workloads[0][:2], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    runs = []
    for prompts in workloads:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(time.perf_counter() - start)
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    import vllm
    with open(job["result_path"], "w") as f:
        json.dump({"startup_s": startup, "runs_s": runs, "output_tokens": n_out,
                   "version": vllm.__version__,
                   "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                   "memory_fraction": job["memory_fraction"]}, f)


if __name__ == "__main__":
    main()
