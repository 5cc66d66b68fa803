"""fp8kit.optim"""
