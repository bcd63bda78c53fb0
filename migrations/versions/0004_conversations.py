"""conversations and their items (DESIGN.md §11); the conversation a response runs on

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "conversation",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=128), nullable=False),
        sa.Column("metadata", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_conversation")),
    )
    op.create_table(
        "conversation_item",
        sa.Column("position", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("conversation_id", sa.String(length=64), nullable=False),
        sa.Column("item_id", sa.Text(), nullable=False),
        sa.Column("item", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("response_id", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(
            ["conversation_id"],
            ["conversation.id"],
            name=op.f("fk_conversation_item_conversation_id_conversation"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("position", name=op.f("pk_conversation_item")),
        sa.UniqueConstraint(
            "conversation_id", "item_id", name=op.f("uq_conversation_item_conversation_id_item_id")
        ),
    )
    op.create_index(
        op.f("ix_conversation_item_conversation_id_position"),
        "conversation_item",
        ["conversation_id", "position"],
    )
    op.add_column("response", sa.Column("conversation_id", sa.String(length=64), nullable=True))


def downgrade() -> None:
    op.drop_column("response", "conversation_id")
    op.drop_index(op.f("ix_conversation_item_conversation_id_position"), table_name="conversation_item")
    op.drop_table("conversation_item")
    op.drop_table("conversation")
