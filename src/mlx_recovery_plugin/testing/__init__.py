"""Test doubles shipped with the package: a mock host that imitates a real MLX server
where the plugin depends on it, tiny real models, and the host contract suite
(:mod:`mlx_recovery_plugin.testing.contract`, opt-in pytest plugin)."""

from .block_pool import BlockPool, BlockReferenceError, PoolExhaustedError
from .engine import CACHE_KINDS, LoadedModel, MockEngine, RequestResult
from .entry_cache import WholeEntryPrefixCache
from .host import MockHost
from .prefix_cache import CacheCounters, PagedPrefixCache, chain_hash
from .tiny_model import TinyModelSpec, load_tiny_model, make_tiny_model, write_tiny_model

__all__ = [
    "CACHE_KINDS",
    "BlockPool",
    "BlockReferenceError",
    "CacheCounters",
    "LoadedModel",
    "MockEngine",
    "MockHost",
    "PagedPrefixCache",
    "PoolExhaustedError",
    "RequestResult",
    "TinyModelSpec",
    "WholeEntryPrefixCache",
    "chain_hash",
    "load_tiny_model",
    "make_tiny_model",
    "write_tiny_model",
]
