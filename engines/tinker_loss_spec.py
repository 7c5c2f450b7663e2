"""Moved to schema/tinker_losses.py; this re-export goes once service/tinker_service.py imports schema."""

from schema.tinker_losses import LossInputError, check_request  # noqa: F401
