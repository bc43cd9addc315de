"""``plait bench vllm``: vLLM CPU serving with the plugin on and off, and ``plait_universal`` load time."""
