"""The recipe: its argument dataclasses and errors, the ground every stage stands on."""
