"""ominix-runtime: the runtime policy layer of an inference-serving stack."""

__version__ = "0.1.0"
