"""workloads/"""
