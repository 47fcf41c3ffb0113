"""The training stage: the TRL seam and what runs inside training."""
