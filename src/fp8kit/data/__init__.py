"""fp8kit.data"""
