"""`respool up`: everything on one machine. Private Redis and Postgres servers (`embedded`), the
supervisor that keeps the API and worker processes running (`supervisor`), and the process helpers
both use (`processes`)."""
