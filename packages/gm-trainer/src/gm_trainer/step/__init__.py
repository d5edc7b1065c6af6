"""Running and ending a step: executor, windows, deferred grads, stepper, state, the loop."""
