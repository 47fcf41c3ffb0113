"""The data stage: loading, row shapes and checks, the built-in model and data, token lengths."""
