"""Integration tests: `plugserve serve` as a real subprocess, driven over HTTP.

A package so that `tests.integration.faulty_plugin` imports from the repository root,
which is how the server subprocess (and its engine) load that test plugin.
"""
