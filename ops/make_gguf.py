"""Write a copy of a GGUF model with its matrices requantized to Q8_0, Q4_0 or Q4_1 (the
metadata, tokenizer included, copied; 1-d tensors such as norms kept as they are), so that
pagoda and llama.cpp can be measured on the same files:

    .venv/bin/python ops/make_gguf.py --type Q8_0 /tmp/SmolLM2-135M-Instruct.Q8_0.gguf

The source is the default model unless --source names another file. Each tensor is dequantized
and requantized with gguf's own numpy code, one at a time.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# llama.cpp's general.file_type values (LLAMA_FTYPE_MOSTLY_*) for the types written here.
_FILE_TYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_1": 3}


def make_gguf(dst: str, qtype_name: str, src: str | None = None) -> str:
    """Write `src` (default: the default model) requantized to `qtype_name` at `dst`; -> dst."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    from shared.model_source import default_model_path
    if qtype_name not in _FILE_TYPES:
        raise ValueError(f"type must be one of {', '.join(_FILE_TYPES)}, got {qtype_name!r}")
    qtype = GGMLQuantizationType[qtype_name]
    reader = GGUFReader(src or default_model_path())
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue  # the writer's own header, and the type written below
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(_FILE_TYPES[qtype_name])
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type)
        if values.ndim == 1:
            writer.add_tensor(t.name, np.array(values, dtype=np.float32))
            continue
        writer.add_tensor(t.name, quantize(np.ascontiguousarray(values, dtype=np.float32), qtype),
                          raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dst", help="the .gguf file to write")
    parser.add_argument("--type", default="Q8_0", choices=sorted(_FILE_TYPES))
    parser.add_argument("--source", default=None, help="GGUF file to requantize (default: the "
                                                       "default model)")
    args = parser.parse_args()
    print(make_gguf(args.dst, args.type, args.source))


if __name__ == "__main__":
    main()
