"""respool's core: the protocol, the store, the event log, the queue, the upstream backends, the runner.

Nothing here imports `api`, FastAPI or Starlette (shared/STYLE.md, boundary 1).
"""
