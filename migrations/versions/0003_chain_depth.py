"""each response's depth in its previous_response_id chain (RESPOOL_MAX_CHAIN_DEPTH)

Revision ID: 0003
Revises: 0002

Rows already stored get their depth from the chains still in the table; a response whose
predecessor is gone (deleted, or past retention) counts from there.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "response", sa.Column("chain_depth", sa.Integer(), server_default=sa.text("0"), nullable=False)
    )
    op.execute(
        """
        WITH RECURSIVE chain(id, depth) AS (
            SELECT id, 0 FROM response
            WHERE previous_response_id IS NULL
               OR previous_response_id NOT IN (SELECT id FROM response)
          UNION ALL
            SELECT next.id, chain.depth + 1 FROM response AS next JOIN chain ON next.previous_response_id = chain.id
        )
        UPDATE response SET chain_depth = chain.depth FROM chain
        WHERE response.id = chain.id AND chain.depth > 0
        """
    )


def downgrade() -> None:
    op.drop_column("response", "chain_depth")
