"""Postgres, the record of every stored response (DESIGN.md §5): the tables (`models`), every query
and compare-and-set (`store`), and the schema's migrations (`migrate`)."""
