"""`python3 -m ops.bench.gpu_check ...`: the GPU check's command line (cli.py)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
