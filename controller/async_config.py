"""Moved to schema/async_rl.py; this re-export goes once controller/async_loop.py imports schema."""

from schema.async_rl import *  # noqa: F403
