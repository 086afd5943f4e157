"""The main job (pipeline and its config) and the paper's studies built on it: the recipe grid and the model garden."""
