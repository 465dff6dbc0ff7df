"""interop/"""
