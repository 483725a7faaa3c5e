"""Test doubles shipped for the conformance CLI and tests: a deterministic fake backend and a fake SGLang server."""
