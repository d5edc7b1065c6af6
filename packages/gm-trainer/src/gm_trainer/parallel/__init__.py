"""Where a step runs: devices, the device mesh, tensor parallelism, ranks, the topology."""
