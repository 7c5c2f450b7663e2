"""Misbehaving user modules for tests/test_user_code.py: never import them in a test process."""
