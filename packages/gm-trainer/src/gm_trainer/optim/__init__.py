"""Optimizers: their config, gradients (add, scale, norm), the in-graph update, LR schedules."""
