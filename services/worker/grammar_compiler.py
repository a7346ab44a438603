"""Compiling structured-output grammars off the step loop, with a cache.

The worker submits a request's grammar the first time it sees the request's parameters; a thread
pool compiles it while steps go on, and the first step that samples for the request waits on the
future only if compilation has not finished. Compiled grammars are cached by what they compile
from (`shared.structured_output.grammar_source`), so requests with the same schema share one.
"""
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from shared.config import ModelConfig
from shared.logging import get_logger
from shared.structured_output import StructuredOutputsParams, grammar_source

log = get_logger("worker.grammar")

_CACHE_SIZE = 256  # compiled grammars kept (each is a few hundred KB at most for small schemas)


class GrammarCompilerPool:
    def __init__(self, model_config: ModelConfig, max_workers: int = 2):
        self.model_config = model_config
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self.cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None
        self.tokenizer_info = None

    @property
    def vocab_size(self) -> int:
        """Width of the logits and of the token bitmask (may exceed the tokenizer's length)."""
        return self.model_config.vocab_size

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of `params`, as a future (already done on a cache hit)."""
        key = grammar_source(params)
        future = self.cache.get(key)
        if future is not None:
            self.cache.move_to_end(key)
            return future
        future = self.pool.submit(self._compile, key)
        self.cache[key] = future
        if len(self.cache) > _CACHE_SIZE:
            self.cache.popitem(last=False)
        return future

    def _compile(self, key: tuple):
        kind, text, options = key
        compiler = self._get_compiler()
        compile_fn = {"json_schema": compiler.compile_json_schema,
                      "regex": compiler.compile_regex,
                      "ebnf": compiler.compile_grammar,
                      "structural_tag": compiler.compile_structural_tag}[kind]
        try:
            return compile_fn(text, **dict(options))
        except Exception:
            # The gateway and the offline engine check grammars first; this is a last resort.
            log.exception("grammar compilation failed", kind=kind)
            raise

    def _get_compiler(self):
        # Built on first use, in a pool thread: loading the tokenizer takes a second or two.
        with self._lock:
            if self._compiler is None:
                import xgrammar

                from shared.tokenizer import get_tokenizer
                tokenizer = get_tokenizer(self.model_config.tokenizer)
                self.tokenizer_info = xgrammar.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgrammar.GrammarCompiler(self.tokenizer_info, max_threads=2)
            return self._compiler

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
