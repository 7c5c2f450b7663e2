"""Moved to schema/engine.py; this re-export goes once engines/fsdp/lora.py and bench/ import schema."""

from schema.engine import *  # noqa: F403
