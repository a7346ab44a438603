"""Attention ops on the paged KV cache: torch reference ops (`reference`), and Triton kernels
beside them that are tested against those references."""
