"""Moved to schema/external.py; this re-export goes once controller/external.py imports schema."""

from schema.external import ExternalSpec, server_name  # noqa: F401
