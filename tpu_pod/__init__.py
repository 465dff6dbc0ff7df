"""tpu_pod/"""
