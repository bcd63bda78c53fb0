"""`respool bench`: what respool costs on top of the upstream it fronts (issue 6).

A paced upstream of its own (`api.bench.upstream`), respool in front of it, and a load generator,
all on loopback; LiteLLM in front of the same upstream when it is installed (`api.bench.litellm`).
"""
