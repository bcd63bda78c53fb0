"""The Redis event log (DESIGN.md §3, §4): one stream per response (`stream`), the leases and fencing
tokens that say who may append to it (`lease`), and one attempt's writer (`writer`)."""
