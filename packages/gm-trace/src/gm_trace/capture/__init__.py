"""Capturing a whole training step as one joint graph: tracer, tracing context, capture errors."""
