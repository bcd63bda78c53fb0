"""`python -m api …` is the `respool` command."""

from api.cli import main

main()
