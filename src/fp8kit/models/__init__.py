"""Model presets (real shapes) and building HF transformers models from configs."""
