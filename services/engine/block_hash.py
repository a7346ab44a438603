"""Identity of a full KV-cache block for prefix caching.

A block's digest is SHA-256 over its parent block's digest and its own token ids, so equal digests
mean equal prefixes. A sequence's first block takes the digest of its request's cache namespace as
its parent: requests in different namespaces never share a block. The digest is the whole map key,
so it has to be collision-resistant (Python's hash() is 64 bits, and two prefixes whose hashes
collided used to share blocks). SHA-256 rather than BLAKE2b: for a 16-token block BLAKE2b was no
faster here (both about 1.1-1.5 µs per block, OpenSSL's SHA-256 using the CPU's SHA instructions).
"""
import functools
import hashlib
import struct

DIGEST_SIZE = 32
MAX_CACHE_SALT_CHARS = 256

# The parent of a first block in requests without a namespace (no salt): they all share blocks.
# No SHA-256 output is known to be all zeros, so it stands for no namespace only.
NO_NAMESPACE = bytes(DIGEST_SIZE)


def check_cache_salt(cache_salt: str | None) -> str | None:
    """The salt itself if it is None or a non-empty str of at most 256 characters, else ValueError."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
    if not 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters, "
                         f"got {len(cache_salt)}")
    return cache_salt


def namespace_digest(cache_salt: str | None) -> bytes:
    """The parent digest of a request's first block. Each field of the namespace is tagged and
    length-prefixed, so a field added later (a LoRA adapter id) cannot be confused with the salt."""
    fields = []
    if cache_salt is not None:
        fields.append((b"cache_salt", cache_salt.encode()))
    if not fields:
        return NO_NAMESPACE
    h = hashlib.sha256(b"pagoda block namespace")
    for name, value in fields:
        h.update(struct.pack("<II", len(name), len(value)))
        h.update(name)
        h.update(value)
    return h.digest()


@functools.lru_cache(maxsize=8)
def _token_packer(num_tokens: int) -> struct.Struct:
    # Fixed-width little-endian uint32: the bytes do not depend on the platform, and a token id
    # outside [0, 2**32) fails loudly instead of being hashed as something else.
    return struct.Struct(f"<{num_tokens}I")


def block_digest(parent_digest: bytes, token_ids: list[int]) -> bytes:
    """The digest of a full block: its parent's digest (32 bytes, so the token bytes that follow
    are never ambiguous) and its token ids."""
    return hashlib.sha256(parent_digest + _token_packer(len(token_ids)).pack(*token_ids)).digest()
