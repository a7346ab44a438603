"""Triton kernels for the CUDA path, one module per op, each computing what its torch
counterpart (`pagoda_kernels.reference` for attention) computes, with the same layouts: paged decode
attention (`paged_attention`), prefill attention over a cached prefix (`prefill_attention`), and
the layer ops beside them.

Importing these modules needs triton, so nothing imports them unconditionally: callers import
them lazily, where the Triton path is chosen. With TRITON_INTERPRET=1 set before a module is
imported, its kernels run on CPU tensors through Triton's interpreter (slowly), which is how they
are tested on machines without a GPU.
"""
