"""The Responses protocol, pure (no I/O): a create request parsed and validated (`request`), the
Response object built from it and its run (`response`), input items normalised with ids (`items`)."""
