"""What the API process runs (DESIGN.md §2): the service the routes call (`responses`), cancels
(`cancellation`), previous_response_id chains (`chains`), per-owner quotas (`quota`) and the one
multiplexed tail of every stream the process relays (`tailer`). Never imports `worker.runner`."""
