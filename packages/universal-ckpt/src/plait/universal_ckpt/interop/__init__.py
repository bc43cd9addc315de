"""Interop with other checkpoint formats: HF safetensors, PyTorch DCP, DeepSpeed ZeRO."""
