"""`python -m api …` is the `respool` command."""

from worker.heap import frozen_imports

with frozen_imports():
    from api.cli import main

main()
