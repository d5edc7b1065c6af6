"""Compiling a step into graph variants and keeping them: compiler, registry, keys."""
