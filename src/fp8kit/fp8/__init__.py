"""fp8kit.fp8"""
