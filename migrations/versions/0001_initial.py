"""responses and their input items

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "response",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("background", sa.Boolean(), nullable=False),
        sa.Column("store", sa.Boolean(), nullable=False),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("previous_response_id", sa.String(length=64), nullable=True),
        sa.Column("request", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("conversation", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("response", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("error", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("attempt", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("completed_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "status IN ('queued', 'in_progress', 'completed', 'failed', 'incomplete', 'cancelled')",
            name=op.f("ck_response_status"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_response")),
    )
    op.create_index(
        "ix_response_live",
        "response",
        ["status"],
        unique=False,
        postgresql_where=sa.text("status IN ('queued', 'in_progress')"),
    )
    op.create_index(op.f("ix_response_owner_created_at"), "response", ["owner", "created_at"], unique=False)
    op.create_table(
        "input_item",
        sa.Column("response_id", sa.String(length=64), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("item_id", sa.Text(), nullable=False),
        sa.Column("item", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.ForeignKeyConstraint(
            ["response_id"],
            ["response.id"],
            name=op.f("fk_input_item_response_id_response"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("response_id", "position", name=op.f("pk_input_item")),
    )
    op.create_index(
        op.f("ix_input_item_response_id_item_id"), "input_item", ["response_id", "item_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_input_item_response_id_item_id"), table_name="input_item")
    op.drop_table("input_item")
    op.drop_index(op.f("ix_response_owner_created_at"), table_name="response")
    op.drop_index(
        "ix_response_live",
        table_name="response",
        postgresql_where=sa.text("status IN ('queued', 'in_progress')"),
    )
    op.drop_table("response")
