"""ominix_worker: the mechanism side of ominix-runtime (weights, KV tensor, attention, sampling) per device."""

__version__ = "0.1.0"
