"""Moved to schema/workers.py; this re-export goes once controller/trainer.py imports schema."""

from schema.workers import UpdateSchedule  # noqa: F401
