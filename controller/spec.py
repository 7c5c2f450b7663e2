"""Moved to schema/job.py; this re-export goes once controller/trainer.py and async_loop.py import schema."""

from schema.job import JobSpec  # noqa: F401
