"""respool's HTTP face: routes that call into `worker`, auth, errors in OpenAI's shape, the SSE relay."""
