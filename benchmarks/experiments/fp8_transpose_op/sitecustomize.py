import os

if os.environ.get("EXP_FP8_T") == "1":
    import fp8_t_patch  # noqa: F401
