"""Fake sglang package (tests only): see tests/fake_sglang_pkg/README.md."""

__version__ = "0.5.13.post1"
