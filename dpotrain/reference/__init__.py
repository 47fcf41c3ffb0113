"""The reference stage: the reference model's log-probabilities, scored once and cached."""
