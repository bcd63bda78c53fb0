"""Alembic migrations for respool's Postgres schema; metadata from `worker.postgres.models`."""
