"""A GGUF model's config and tokenizer, converted by transformers once and then kept as Hugging
Face files in the cache.

transformers rebuilds both from the GGUF file's metadata on every load, walking the whole
vocabulary in Python: for the default model ~10 s for the config and ~8 s for the tokenizer, in
every process that starts (engine, worker, tokenizers, detokenizers, the gateway). The converted
files go to `$PAGODA_CACHE_DIR/gguf-meta/<key>/{config,tokenizer}` (default ~/.cache/pagoda),
the key naming the file (path, size, modification time) and the transformers version that
converted it; later loads read them in well under a second. Where the cache cannot be written,
or an entry cannot be read back, the load converts again, as before. Entries of files or
transformers versions no longer used are not removed.
"""
import hashlib
import os
import shutil
import tempfile

from shared.cache import cache_root
from shared.logging import get_logger
from shared.model_source import ModelSource

log = get_logger("gguf")


def cache_folder(source: ModelSource, part: str) -> str:
    """Where `part` of this GGUF file's conversions is kept."""
    import transformers
    st = os.stat(source.path)
    key = f"{os.path.abspath(source.path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(cache_root(), "gguf-meta", digest, part)


def _cached(source: ModelSource, part: str, convert, load):
    """`load(folder)` of the cached conversion; on a miss (or an entry that does not load),
    `convert()` and save it there (written beside and renamed, so processes starting together
    never read half a folder)."""
    folder = cache_folder(source, part)
    if os.path.isdir(folder):
        try:
            return load(folder)
        except Exception as e:  # damaged or unreadable: the conversion still works
            log.warning("cached GGUF conversion does not load; converting", part=part,
                        folder=folder, error=str(e))
            return convert()
    converted = convert()
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{part}-", dir=os.path.dirname(folder))
        try:
            converted.save_pretrained(tmp)
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o755 & ~umask)  # mkdtemp's 0700 would keep other users of a cache out
            os.rename(tmp, folder)
            log.info("cached the GGUF conversion", part=part, folder=folder)
        except OSError:
            if not os.path.isdir(folder):  # not another process's win: a real failure
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as e:
        log.warning("cannot cache the GGUF conversion; converting on every load", part=part,
                    error=str(e))
    return converted


def load_config(source: ModelSource):
    from transformers import AutoConfig
    return _cached(source, "config",
                   lambda: AutoConfig.from_pretrained(source.folder, gguf_file=source.gguf_file),
                   AutoConfig.from_pretrained)


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer
    return _cached(source, "tokenizer",
                   lambda: AutoTokenizer.from_pretrained(source.folder,
                                                         gguf_file=source.gguf_file),
                   AutoTokenizer.from_pretrained)
