"""The Postgres schema (DESIGN.md §5, §11): the `response` table and its `input_item` rows; the
`conversation` table and its `conversation_item` rows; the `server_key` table.

Alembic (migrations/) builds its migrations from this metadata.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from worker.protocol.response import LIVE, Status

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
STATUSES = ", ".join(f"'{status}'" for status in Status)
LIVE_STATUSES = ", ".join(f"'{status}'" for status in LIVE)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class ResponseRow(Base):
    """A response: the request as received, the conversation it runs on, and its current Response object."""

    __tablename__ = "response"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(16))
    model: Mapped[str] = mapped_column(Text)
    background: Mapped[bool]
    store: Mapped[bool]
    stream: Mapped[bool]
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    request: Mapped[dict[str, Any]] = mapped_column(JSONB)
    # Earlier turns (from previous_response_id) then this request's input: what the upstream is sent.
    conversation: Mapped[list[dict[str, Any]]] = mapped_column(JSONB)
    # The Response object as it stands: the queued snapshot, then in_progress, then the final one.
    response: Mapped[dict[str, Any]] = mapped_column(JSONB)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    attempt: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    # How many responses precede this one through previous_response_id (0: none); bounded by
    # RESPOOL_MAX_CHAIN_DEPTH.
    chain_depth: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    # The conversation it runs on, whose items it appends when it ends (no foreign key: deleting the
    # conversation leaves the response retrievable).
    conversation_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        CheckConstraint(f"status IN ({STATUSES})", name="status"),
        Index(None, "owner", "created_at"),
        # The sweep looks only at live rows (DESIGN.md §5).
        Index("ix_response_live", "status", postgresql_where=text(f"status IN ({LIVE_STATUSES})")),
        # Retention deletes by completion time (DESIGN.md §2.7).
        Index("ix_response_completed_at", "completed_at", postgresql_where=text("completed_at IS NOT NULL")),
    )


class InputItemRow(Base):
    """One item of a response's own input, in order; `input_items.list` pages over these."""

    __tablename__ = "input_item"

    response_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("response.id", ondelete="CASCADE"), primary_key=True
    )
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    item_id: Mapped[str] = mapped_column(Text)
    item: Mapped[dict[str, Any]] = mapped_column(JSONB)

    __table_args__ = (Index(None, "response_id", "item_id"),)


class ConversationRow(Base):
    """A conversation (DESIGN.md §11): its owner and metadata; its items are `conversation_item` rows."""

    __tablename__ = "conversation"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128))
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSONB)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class ConversationItemRow(Base):
    """One item of a conversation. `position` comes from one sequence, so items added later (by
    a later transaction) sort after: responses' items land in the order the responses finish."""

    __tablename__ = "conversation_item"

    position: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    conversation_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("conversation.id", ondelete="CASCADE")
    )
    item_id: Mapped[str] = mapped_column(Text)
    item: Mapped[dict[str, Any]] = mapped_column(JSONB)
    # The response whose input or output the item was (None: added through the items route).
    response_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())

    __table_args__ = (
        UniqueConstraint("conversation_id", "item_id"),
        Index(None, "conversation_id", "position"),
    )


class ServerKeyRow(Base):
    """A key the servers share, made once by whichever process needs it first: the compaction key
    (worker/protocol/compaction.py) when the operator configured none (RESPOOL_COMPACTION_KEYS)."""

    __tablename__ = "server_key"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class WebhookDeliveryRow(Base):
    """One event to one endpoint (DESIGN.md §12): inserted in the transaction that records the
    response's end, then tried until delivered or given up. Its id is the event's (`webhook-id`)."""

    __tablename__ = "webhook_delivery"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    response_id: Mapped[str] = mapped_column(String(64))
    owner: Mapped[str] = mapped_column(String(128))
    endpoint: Mapped[str] = mapped_column(String(128))  # its name in the configuration
    url: Mapped[str] = mapped_column(Text)
    event_type: Mapped[str] = mapped_column(String(32))
    body: Mapped[str] = mapped_column(Text)  # the event's JSON, the same bytes on every attempt
    status: Mapped[str] = mapped_column(String(16), server_default=text("'pending'"))
    attempts: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    # When it may be tried next; while an attempt runs, when that attempt is given up for dead.
    next_attempt_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        CheckConstraint("status IN ('pending', 'delivered', 'given_up')", name="status"),
        Index(None, "response_id"),
        Index("ix_webhook_delivery_due", "next_attempt_at", postgresql_where=text("status = 'pending'")),
    )


class WebhookAttemptRow(Base):
    """One attempt of a delivery: what the receiver answered, or why it could not."""

    __tablename__ = "webhook_attempt"

    id: Mapped[int] = mapped_column(BigInteger, Identity(always=True), primary_key=True)
    delivery_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("webhook_delivery.id", ondelete="CASCADE"), index=True
    )
    attempt: Mapped[int] = mapped_column(Integer)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    status_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    duration_ms: Mapped[int] = mapped_column(Integer)
