"""Attention backends behind one interface (`AttentionBackend`)."""
from services.worker.attention.base import AttentionBackend, AttentionMetadata, get_attn_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attn_backend"]
