import os

if os.environ.get("EXP_GRAD_NO_ROPE") == "1":
    import grad_cast_rope_patch  # noqa: F401
