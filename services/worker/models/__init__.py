"""Model architectures pagoda runs on its paged KV cache."""
from services.worker.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
