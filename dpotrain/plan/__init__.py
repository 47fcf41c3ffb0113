"""The plan and memory stages: steps cut into micro-batches, the memory plan, decoder layers."""
