"""fp8kit.bench"""
