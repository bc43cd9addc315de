"""The moe-layers benchmark suite (``plait bench moe-layers``)."""
