"""A GGUF model's config and tokenizer are converted once, kept in the cache, and read back the
same; a changed file is a new entry; an unwritable cache only costs the conversion."""
import os

from shared import gguf_meta
from shared.model_source import ModelSource, resolve_model

TEXT = "Hello, world! <|im_start|>user\nWhat's 2+2?<|im_end|> ünïcödé"


def test_config_and_tokenizer_are_cached_and_read_back_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path))
    source = resolve_model(None)
    assert source.gguf_file
    converted = gguf_meta.load_config(source)
    folder = gguf_meta.cache_folder(source, "config")
    assert folder.startswith(str(tmp_path)) and os.path.isfile(os.path.join(folder, "config.json"))
    cached = gguf_meta.load_config(source)
    assert cached.name_or_path == folder  # read from the cache, not converted again
    differing = {k for k, v in converted.to_dict().items() if cached.to_dict().get(k) != v}
    assert differing == {"_name_or_path"}

    tokenizer = gguf_meta.load_tokenizer(source)
    folder = gguf_meta.cache_folder(source, "tokenizer")
    cached = gguf_meta.load_tokenizer(source)
    assert cached.name_or_path == folder
    assert cached(TEXT).input_ids == tokenizer(TEXT).input_ids
    ids = list(range(0, len(tokenizer), 97))
    assert cached.decode(ids) == tokenizer.decode(ids)
    assert cached.chat_template == tokenizer.chat_template
    assert cached.all_special_ids == tokenizer.all_special_ids
    assert not [p for p in os.listdir(os.path.dirname(folder)) if p.startswith(".")]  # no temp
    # Other users of a shared cache can read it (mkdtemp alone would leave it 0700).
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(folder).st_mode & 0o777 == 0o755 & ~umask

    # A damaged entry costs the conversion, not the load.
    with open(os.path.join(gguf_meta.cache_folder(source, "config"), "config.json"), "w") as f:
        f.write("{not json")
    assert gguf_meta.load_config(source).to_dict() == converted.to_dict()


def test_a_changed_file_gets_a_new_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    source = ModelSource(str(tmp_path), "model.gguf", "model")
    before = gguf_meta.cache_folder(source, "config")
    assert before == gguf_meta.cache_folder(source, "config")
    os.utime(path, ns=(1, 1))
    assert gguf_meta.cache_folder(source, "config") != before


def test_an_unwritable_cache_still_loads_the_config(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(blocker))
    config = gguf_meta.load_config(resolve_model(None))
    assert config.model_type == "llama" and config.num_hidden_layers == 30
