"""The one end of a step: optimizer config, stepper, in-graph update, non-finite policy, LR."""
