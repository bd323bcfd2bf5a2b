"""Shared fixtures of the cluster tests.

``ray_cluster``, the private local Ray cluster a module's runs join, is in tests/conftest.py:
one cluster serves consecutive test files in a pytest process (tests/functional uses it too).
"""
