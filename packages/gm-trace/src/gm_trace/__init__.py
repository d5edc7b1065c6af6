"""Graph Mode torch layer: the joint forward+backward tracer and the torch graph passes.

Work in progress: the tracer and the FSDP/overlap passes land in their own releases; nothing
is exported yet.
"""

__all__: list[str] = []
