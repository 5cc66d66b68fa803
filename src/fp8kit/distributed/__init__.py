"""fp8kit.distributed"""
