"""The FP8 engine: recipes, scaling (the one scale formula), the torchao import."""
