"""fp8kit.models"""
