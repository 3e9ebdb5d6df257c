"""Fixtures shared by tests/state/'s modules: `finished` (one real run) lives in tests/conftest.py."""
