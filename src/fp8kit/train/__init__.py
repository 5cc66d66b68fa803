"""fp8kit.train"""
