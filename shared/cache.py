"""pagoda's cache directory, shared by whatever keeps files between runs (compiled kernels,
converted model metadata)."""
import os


def cache_root() -> str:
    """$PAGODA_CACHE_DIR, or ~/.cache/pagoda."""
    return os.environ.get("PAGODA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                              "pagoda")
