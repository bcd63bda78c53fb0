"""What the worker process runs (DESIGN.md §2, §4, §7): the worker (`worker`), one attempt at a
response (`attempt`), its shared state (`runtime`), the upstream call (`upstream`), the synthetic
model (`synthetic`), the orphan sweep (`recovery`) and the worker's metrics (`metrics`). Never
imports `worker.service`.
"""
