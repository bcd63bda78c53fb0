"""What the worker process runs (DESIGN.md §2, §4, §7): the RQ worker (`worker`), one attempt at a
response (`attempt`), its shared state (`runtime`), the upstream call (`upstream`), the synthetic
model (`synthetic`), the orphan sweep (`recovery`) and the worker's metrics (`metrics`). Never
imports `worker.service`.

`run_job` is here too: RQ stores the dotted path of a job's function in each job, and jobs queued
before this package existed name `worker.runner.run_job`.
"""

from worker.runner.attempt import run_job

__all__ = ["run_job"]
