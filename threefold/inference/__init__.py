"""Using a model rather than training it: loading a checkpoint into a layout, forward-only
passes through the pipeline, validation loss, and sampling with a KV cache."""
