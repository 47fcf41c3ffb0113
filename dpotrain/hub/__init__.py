"""The last stage: the model card and the pushes to the Hugging Face Hub."""
