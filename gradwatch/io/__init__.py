"""Records and where they go: JSONL, TensorBoard and log sinks, and reading runs back (``gradwatch report``)."""
